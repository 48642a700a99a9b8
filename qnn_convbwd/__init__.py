"""qnn_convbwd"""
