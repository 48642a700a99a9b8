"""QNN SDK discovery, the HTP compatibility shim, and compile/run helpers."""

from .sdk import SdkInfo, SdkUnavailable, active_sdk, ensure_sdk

__all__ = ["SdkInfo", "SdkUnavailable", "active_sdk", "ensure_sdk"]
