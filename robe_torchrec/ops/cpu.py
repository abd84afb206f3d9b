"""Multithreaded C++ ROBE-Z kernels for CPU tensors (``csrc/``: ``common.h`` lists its files).

Same signatures as :mod:`robe_torchrec.ops.reference`. The extension is compiled on first
use with ``torch.utils.cpp_extension.load`` (``-O3 -march=native -fopenmp``) and cached on
disk, in ``~/.cache/robe_torchrec/<torch version>-<hash of every file of csrc/, the torch
version and build, the flags and this CPU's flags>`` (:func:`cache_key`) or in
``$ROBE_TORCHREC_BUILD_DIR``. A later process with the same sources, torch build, flags and
CPU loads the cached build without compiling, from any checkout or virtual environment. The build registers its
functions as operators of its own library, ``torch.ops.robe_torchrec_cpu``, which
:func:`extension` returns (no pybind11: the build takes about half the time,
``benchmarks/results/probes/build_time.md``). The kernels run on ``torch.get_num_threads()``
threads (``torch.set_num_threads``).

The wrappers only run :func:`~robe_torchrec.ops.validation.check_static` (dtypes and shapes);
the C++ checks offsets, id bounds and per-sample weights inside its own loops and raises
``ValueError`` with the messages of :mod:`robe_torchrec.ops.validation`.

Example::

    >>> from robe_torchrec.ops import cpu
    >>> out = cpu.forward(weights, values, offsets, None, meta, 24, 4, 0, params, 0)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import threading
from typing import Iterator, List, Optional, Sequence, Union

import torch

from robe_torchrec.ops.validation import check_static, with_rate

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_HEADERS = [os.path.join(_CSRC, f"{name}.h")
            for name in ("common", "hash", "layout", "loops", "forward", "optimizers", "ops")]
# what the kernels' extension builds: its translation units (the .cpp) and every header they
# include (copied next to them, see build())
_SOURCES = [os.path.join(_CSRC, f"{name}.cpp") for name in ("forward", "backward", "register")] + _HEADERS
_NAME = "robe_torchrec_cpu"
# the forward's profiling aids, a benchmark build of their own (forward_hash_only below)
_PARTS_SOURCES = [os.path.join(_CSRC, "forward_parts.cpp")] + _HEADERS
_PARTS_NAME = "robe_torchrec_cpu_parts"
# -fopenmp is required: at::parallel_for in the ATen headers is an `omp parallel` region,
# which without it silently runs on one thread. -fno-math-errno lets sqrt vectorise.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module = None
_parts_module = None


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return ""


def _csrc_files() -> List[str]:
    """Every file of ``csrc/`` (sub-folders included, whatever their names) and every file
    the build compiles: what the cache key hashes."""
    found = set(os.path.abspath(p) for p in _SOURCES)
    for root, dirs, files in os.walk(_CSRC):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found.update(os.path.join(root, f) for f in files if not f.endswith((".pyc", ".tmp")))
    return sorted(found)


def cache_key(files: Optional[Sequence[str]] = None) -> str:
    """The build cache's key: a hash of the sources (each file's name within ``csrc/`` and
    its bytes), the torch version and build, the compiler and linker flags, this CPU's flags
    (``-march=native``) and the Python ABI. Nothing of where the sources, torch or the
    interpreter are installed: two checkouts or virtual environments of the same source and
    torch build share one build."""
    digest = hashlib.sha256()
    for path in files if files is not None else _csrc_files():
        rel = os.path.relpath(path, _CSRC)
        name = rel if not rel.startswith("..") else os.path.basename(path)
        with open(path, "rb") as f:
            data = f.read()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    parts = [digest.hexdigest(), torch.__version__, getattr(torch.version, "git_version", ""),
             str(torch.version.cuda), " ".join(CFLAGS), " ".join(LDFLAGS), _cpu_flags_line(),
             sys.implementation.cache_tag or ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def build_directory() -> str:
    """Where the compiled extension is cached (created on demand):
    ``~/.cache/robe_torchrec/<torch version>-<cache_key()>``, or ``$ROBE_TORCHREC_BUILD_DIR``."""
    override = os.environ.get("ROBE_TORCHREC_BUILD_DIR")
    if override:
        return override
    # Keyed by content only (cache_key): the key used to hold the torch install's path and
    # the ninja's, so every virtual environment compiled its own copy. A finished build is
    # now loaded without ninja (build(): its stamp), which is what made those paths matter:
    # build.ninja names torch's include directory, and another environment's ninja would
    # have rebuilt.
    return os.path.join(os.path.expanduser("~"), ".cache", "robe_torchrec",
                        f"{torch.__version__}-{cache_key()}")


def _interpreter_bin() -> str:
    return os.path.dirname(sys.executable)


def _ninja() -> Optional[str]:
    """The ninja the build uses: the one installed next to this interpreter (a venv's, a
    dependency of this package) if any, else the first on PATH."""
    local = shutil.which("ninja", path=_interpreter_bin())
    return local or shutil.which("ninja")


@contextlib.contextmanager
def _interpreter_bin_first_on_path() -> Iterator[None]:
    # torch's builder runs whatever `ninja` PATH finds: make it the interpreter's, so that
    # `python -m ...` with or without the venv activated builds (and caches) the same way
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = _interpreter_bin() + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _find_compiler() -> Optional[str]:
    for name in filter(None, [os.environ.get("CXX"), "c++", "g++"]):
        if shutil.which(name):
            return name
    return None


def build(name: str, sources: Union[str, Sequence[str]], directory: Optional[str] = None):
    """Build (or load, if up to date) the C++ files ``sources`` (a path or paths: translation
    units and the headers they include) as extension module ``name`` in ``directory``
    (default: :func:`build_directory`), with this package's flags and toolchain.
    :func:`extension` builds the kernels with it, :func:`parts_extension` the benchmark's
    profiling build."""
    if _find_compiler() is None:
        raise RuntimeError(
            "robe: the C++ CPU kernels need a C++ compiler to build, and none was found "
            "(looked for $CXX, c++ and g++). Install g++ (e.g. `apt-get install g++`) or "
            "set ROBE_CPU_BACKEND=reference to use the pure-PyTorch ops instead."
        )
    from torch.utils.cpp_extension import load

    directory = directory or build_directory()
    os.makedirs(directory, exist_ok=True)
    # Compile a copy kept in the build directory: build.ninja names the source's path, so
    # compiling the package's own file would rebuild whenever the same kernel is loaded
    # from another place (a checkout and a wheel install, two clones).
    # The copies keep their names, side by side: the .cpp files include the headers by name.
    sources = [sources] if isinstance(sources, str) else list(sources)
    local_sources = []
    for source in sources:
        local = os.path.join(directory, os.path.basename(source))
        _write_if_changed(local, source)
        if local.endswith(".cpp"):
            local_sources.append(local)
    # a finished build of exactly these sources, flags and torch: load it without ninja,
    # which would rebuild it for another checkout or environment (build.ninja holds paths)
    stamp, key = os.path.join(directory, f"{name}.built"), cache_key(sources)
    library = os.path.join(directory, f"{name}.so")
    if _read(stamp) == key and os.path.isfile(library):
        torch.ops.load_library(library)
        return getattr(torch.ops, name)
    with _interpreter_bin_first_on_path():
        load(name=name, sources=local_sources, extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
             build_directory=directory, is_python_module=False,
             verbose=bool(os.environ.get("ROBE_TORCHREC_VERBOSE_BUILD")))
    tmp = f"{stamp}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(key)
    os.replace(tmp, stamp)
    # the operators the library registered under its own namespace, called like module functions
    return getattr(torch.ops, name)


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _write_if_changed(path: str, source: str) -> None:
    """Copy ``source`` to ``path`` unless it already holds the same bytes (an unchanged file
    keeps its timestamp, so ninja does not rebuild); the write is atomic, for ranks that
    start together."""
    with open(source, "rb") as f:
        text = f.read()
    try:
        with open(path, "rb") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(text)
    os.replace(tmp, path)


def extension():
    """The compiled extension module (built or loaded on first call; thread-safe)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            _module = build(_NAME, _SOURCES)
    return _module


def parts_extension():
    """The benchmark build of the forward's profiling aids (``forward_parts.cpp``, an extension
    of its own next to :func:`extension`'s; built or loaded on first call; thread-safe)."""
    global _parts_module
    if _parts_module is not None:
        return _parts_module
    with _lock:
        if _parts_module is None:
            _parts_module = build(_PARTS_NAME, _PARTS_SOURCES, os.path.join(build_directory(), "parts"))
    return _parts_module


@contextlib.contextmanager
def _value_errors() -> Iterator[None]:
    """Data errors found by the C++ (messages starting with 'robe:') surface as ValueError."""
    try:
        yield
    except ValueError:
        raise
    except RuntimeError as exc:
        message = str(exc)
        if message.startswith("robe:"):
            raise ValueError(message) from None
        raise


def _ints(values: List[int]) -> List[int]:
    return [int(v) for v in values]


def forward(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    output_dim: int,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    bounds_check: int,
) -> torch.Tensor:
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    ext = extension()
    with _value_errors():
        return ext.forward(weights, values, offsets, per_sample_weights, table_meta, int(output_dim),
                           int(block_size), int(hash_mode), _ints(hash_params), int(bounds_check))


def backward_dense(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    ext = extension()
    with _value_errors():
        return ext.backward_dense(grad_output, weights, values, offsets, per_sample_weights, table_meta,
                                  int(block_size), int(hash_mode), _ints(hash_params))


def per_sample_weights_grad(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    check_static(weights, values, offsets, None, table_meta, block_size, hash_mode)
    ext = extension()
    with _value_errors():
        return ext.per_sample_weights_grad(grad_output, weights, values, offsets, table_meta,
                                           int(block_size), int(hash_mode), _ints(hash_params))


def backward_fused_(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    optimizer: int,
    hparams: List[float],
    step: int,
    lr: Optional[torch.Tensor] = None,
) -> None:
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    hparams = with_rate(hparams, lr, weights)
    ext = extension()
    with _value_errors():
        ext.backward_fused_(grad_output, weights, state1, state2, values, offsets, per_sample_weights,
                            table_meta, int(block_size), int(hash_mode), _ints(hash_params),
                            int(optimizer), [float(h) for h in hparams], int(step))


def forward_hash_only(*forward_args) -> int:
    """Benchmark aid: :func:`forward`'s hash pass alone (its loops, id checks, hashes and
    tile buffers, without prefetches, gathers and output writes); returns the sum of every
    block's start in the flat weights. Runs :func:`parts_extension`, not the kernels' build."""
    ext = parts_extension()
    with _value_errors():
        return int(ext.forward_part(*forward_args, 1))


def forward_gather_only(*forward_args) -> torch.Tensor:
    """Benchmark aid: :func:`forward` without its output stores (hashing, gathers and pooling
    as the forward does them); returns the forward's output summed over its rows, [output_dim].
    Runs :func:`parts_extension`, not the kernels' build."""
    ext = parts_extension()
    with _value_errors():
        return ext.forward_part(*forward_args, 2)


__all__ = [
    "backward_dense",
    "build",
    "backward_fused_",
    "build_directory",
    "extension",
    "forward",
    "forward_gather_only",
    "forward_hash_only",
    "parts_extension",
    "per_sample_weights_grad",
]
