"""The Triton kernels of the ROBE-Z ops, by phase; their host side (tile sizes, checks,
launches) is :mod:`robe_torchrec.ops.triton_kernels`, the module the ops call.

* :mod:`~robe_torchrec.ops.triton.common`: ``triton`` (or a stand-in without it), the
  constants the kernels read, numeric helpers;
* :mod:`~robe_torchrec.ops.triton.hash`: the hash helpers (:mod:`robe_torchrec.hashing`,
  bit-exact);
* :mod:`~robe_torchrec.ops.triton.bags`: the traversal and input-check helpers of the bag
  kernels;
* :mod:`~robe_torchrec.ops.triton.forward`, :mod:`~robe_torchrec.ops.triton.backward`,
  :mod:`~robe_torchrec.ops.triton.optimizers`: the kernels.

Layout of the work
------------------
One launch serves all ``T`` features. A program owns one bag ``(t, b)`` (``program_id(0)
= t * B + b``, the bag's position in ``offsets``) and, for forward/backward, one tile of its
columns (``program_id(1)``). A column tile is a ``[BLOCK_B, BLOCK_Z]`` grid of
``(ROBE block, offset in block)`` pairs, so the hash is computed once per block (not once per
column) and broadcast over the ``Z`` elements of the block::

    column j = blk * Z + s,   blk in tile * BLOCK_B + [0, BLOCK_B),  s in [0, BLOCK_Z)

(``BLOCK_Z`` is ``Z`` rounded up to a power of two; columns with ``s >= Z`` or ``j >= D_t``
are masked). The program walks its bag ``BLOCK_N`` ids at a time (dynamic loop bounds from
``offsets``); every step handles a ``[BLOCK_N, BLOCK_B, BLOCK_Z]`` tile of elements::

    idx = W_OFFSET + start(key, blk) + s          (start from the hash helpers below)

The hash helpers (:func:`_reference_start`, :func:`_mix_start`) re-implement
:mod:`robe_torchrec.hashing` bit-exactly: int64 arithmetic for the reference hash, uint64
wrapping multiplies and logical shifts for the mix hash.

Accumulation is in float32 (float64 for float64 weights), and so is the pooled output: float16
and bfloat16 weights are read as stored and give a float32 output; the fused update steps them
in float32 and writes them back rounded, with float32 optimizer state. Gradients are scattered with
``tl.atomic_add``: float32 atomics on the GPU make ``backward_dense`` (and the fused update)
non-deterministic in the last bits, unless the gradient is summed in a fixed order
(:func:`~robe_torchrec.ops.triton.backward._gather_gradient_kernel`: on CUDA under
``torch.use_deterministic_algorithms(True)``, or with ``TritonTuning.deterministic_backward``).
"""
