"""Graph rewrites and executorch pass extensions for convolution_backward."""

from .shape_only_operands import replace_shape_only_operands
from .tuple_outputs import preserve_output_dtypes, record_output_dtypes

__all__ = ["preserve_output_dtypes", "record_output_dtypes", "replace_shape_only_operands"]
