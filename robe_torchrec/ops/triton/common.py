"""What every Triton kernel module shares: ``triton`` itself (or a stand-in when it is
missing: the package must import without it, and the host raises at call time), the
constants the ``@triton.jit`` code reads, and IEEE-rounded float helpers."""

from typing import Optional

from robe_torchrec.hashing import FMIX_C1, FMIX_C2, GOLDEN, REFERENCE_PRIME, HashMode
from robe_torchrec.ops import meta as m

try:
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # the module must import without triton; calls raise instead
    _TRITON_IMPORT_ERROR = exc

    class _Missing:
        """Stand-in for ``triton`` / ``triton.language`` so the definitions below evaluate."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    triton = tl = _Missing()

# --- constants visible inside @triton.jit code ------------------------------------------
_REFERENCE_PRIME = tl.constexpr(REFERENCE_PRIME)
_GOLDEN = tl.constexpr(GOLDEN)
_FMIX_C1 = tl.constexpr(FMIX_C1)
_FMIX_C2 = tl.constexpr(FMIX_C2)
_HASH_REFERENCE = tl.constexpr(int(HashMode.REFERENCE))
_MEAN = tl.constexpr(int(m.Pooling.MEAN))
_SGD = tl.constexpr(int(m.Optimizer.SGD))
_ADAGRAD = tl.constexpr(int(m.Optimizer.ADAGRAD))
_ADAM = tl.constexpr(int(m.Optimizer.ADAM))
_F_OUT_OFFSET = tl.constexpr(m.OUT_OFFSET)
_F_DIM = tl.constexpr(m.DIM)
_F_W_OFFSET = tl.constexpr(m.W_OFFSET)
_F_W_SIZE = tl.constexpr(m.W_SIZE)
_F_ROW_OFFSET = tl.constexpr(m.ROW_OFFSET)
_F_NUM_ROWS = tl.constexpr(m.NUM_ROWS)
_F_POOLING = tl.constexpr(m.POOLING)


@triton.jit
def _i64(x):
    """``x`` as an int64 tensor, whether it arrived as a tensor or as a Python int: Triton
    turns an integer argument equal to 1 into the constant 1 (no ``.to``), and the
    interpreter keeps a Python int in [2**31, 2**32) as uint32 data typed int64. Adding a
    zero is free when compiled."""
    return x + tl.zeros([], dtype=tl.int64)


@triton.jit
def _div_rn(x, y):
    """IEEE (round-to-nearest) division, as torch divides; Triton's float32 ``/`` may not be."""
    if x.dtype == tl.float32:
        q = tl.div_rn(x, y)
    else:
        q = x / y
    return q


@triton.jit
def _sqrt_rn(x):
    """IEEE square root, as torch's; ``tl.sqrt`` on float32 is approximate."""
    if x.dtype == tl.float32:
        r = tl.sqrt_rn(x)
    else:
        r = tl.sqrt(x)
    return r
