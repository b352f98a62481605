"""infer.kernels."""

from . import isa as _isa

try:
    _isa.hold_torch_to_class()  # a forced INFER_ISA holds torch's own CPU kernels to that class too
except ValueError:
    pass  # a bad INFER_ISA is reported where the kernels are chosen (kernels/resolver.py), naming the fix
