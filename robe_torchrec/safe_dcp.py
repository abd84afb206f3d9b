"""Read a ``torch.distributed.checkpoint`` (DCP) checkpoint you did not write, without
running code from it.

DCP trusts its checkpoint in two places: its ``.metadata`` file is a pickle it loads in
full, and every non-tensor entry (``BytesStorageMetadata``) is read back with
``torch.load(weights_only=False)``. Here:

* :func:`read_metadata_safely` unpickles ``.metadata`` admitting only DCP's metadata
  classes and the plain values they hold, refuses a pickle that would set attributes of a
  class (an admitted one included), and checks that what it read has DCP's shape, with
  every storage file a plain name inside the checkpoint;
* :class:`SafeLoadPlanner` reads non-tensor entries with ``torch.load(weights_only=True)``;
* :func:`safe_load` is ``dcp.load`` with both (:class:`SafeFileSystemReader` and the
  planner). Tensor files DCP reads itself, with ``weights_only=True`` or as raw bytes.

Example::

    >>> state = {"model": model.state_dict()}
    >>> safe_load(state, "outputs/run/checkpoints/step_100", no_dist=True)
    >>> model.load_state_dict(state["model"])
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from robe_torchrec.weights_only import refusal


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (the message names it and says why)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint's DCP metadata names something other than DCP's metadata classes (a
    pickle that would run code, or not DCP's at all); it was not unpickled."""


def _dcp_globals() -> Dict[tuple, Any]:
    """Every global that DCP's ``.metadata`` pickle may name: DCP's metadata classes, the
    plain values they hold (``torch.Size``, dtypes, layouts, paths) and nothing that runs
    code on its own when called with the arguments a pickle can give it."""
    allowed: Dict[tuple, Any] = {}
    for cls in (dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata,
                dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata,
                dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
                dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo):
        allowed[(cls.__module__, cls.__name__)] = cls
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    # how torch pickles a layout: a lookup of its name in a table of torch's layouts
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # DCP records the checkpoint's path; the class is pathlib's, under the module name
    # that wrote it (pathlib._local from Python 3.13)
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath,
                pathlib.PureWindowsPath):
        for module in ("pathlib", "pathlib._local"):
            allowed[(module, cls.__name__)] = cls
    return allowed


class _Refused(pickle.UnpicklingError):
    """What :class:`_MetadataUnpickler` refuses on purpose (as against garbage bytes)."""


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Resolves only :func:`_dcp_globals`: any other global stops the load before it is
    looked up, so no function or class outside the list is ever called. Python's own
    unpickler, not the C one, so that its BUILD step can be refused for a class: a pickle
    may otherwise set attributes of an admitted class, for the whole process, even when
    the file is refused afterwards."""

    allowed: Dict[tuple, Any] = {}
    #: the admitted classes, whose objects (and only those) a pickle may fill in: a
    #: function's or a class's attributes would change for the whole process
    built: frozenset = frozenset()
    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise _Refused(
                f"it names {module}.{name}, which is not one of DCP's metadata classes (a "
                f"checkpoint's metadata holding it could run code when unpickled)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent reference, which DCP's metadata never does")

    def _build(self) -> None:
        target = self.stack[-2]
        if type(target) not in self.built:
            what = f"the class {target.__name__} itself" if isinstance(target, type) \
                else f"a {type(target).__name__}"
            raise _Refused(f"it sets attributes of {what}, where DCP's metadata only fills "
                           f"in objects of its classes")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _build


def read_metadata_safely(path: "str | os.PathLike", rank: Optional[int] = None
                         ) -> "dcp_metadata.Metadata":
    """DCP's metadata of checkpoint ``path`` (its ``.metadata``), unpickled with only DCP's
    metadata classes admitted; raises :class:`UnsafeCheckpointError` naming the file for
    anything else, :class:`CheckpointError` for a file that is not DCP metadata at all."""
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    file = Path(path) / name
    _refuse_links(file, file)
    try:
        data = file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read DCP's metadata ({e})") from e
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _dcp_globals()
        _MetadataUnpickler.built = frozenset(
            v for v in _MetadataUnpickler.allowed.values() if isinstance(v, type))
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeCheckpointError(f"{file}: refused, not unpickled: {e}. Load only "
                                    f"checkpoints written by this app") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{file}: not DCP metadata ({e})") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbage bytes raise anything
        raise CheckpointError(f"{file}: not DCP metadata ({type(e).__name__}: {e})") from None
    _check_metadata(metadata, file)
    return metadata


def _check_metadata(metadata: Any, file: Path) -> None:
    """Refuse metadata whose shape is not DCP's, so that DCP meets only the types it wrote,
    and storage files outside the checkpoint's folder."""
    storage = (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file}: not DCP metadata (it holds a "
                              f"{type(metadata).__name__})")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict) or not all(
            isinstance(k, str) and isinstance(v, storage) for k, v in entries.items()):
        raise CheckpointError(f"{file}: not DCP metadata (its state_dict_metadata is not a "
                              f"dict of DCP storage entries)")
    data = getattr(metadata, "storage_data", None)
    if not isinstance(data, dict) or not all(
            isinstance(k, dcp_metadata.MetadataIndex) and isinstance(v, _StorageInfo)
            for k, v in data.items()):
        raise CheckpointError(f"{file}: not DCP metadata written to files (its storage_data "
                              f"is not a dict of MetadataIndex to _StorageInfo)")
    for info in data.values():
        relative = info.relative_path
        if not isinstance(relative, str) or PurePosixPath(relative).name != relative \
                or relative in ("", ".", "..") or "\\" in relative:
            raise UnsafeCheckpointError(f"{file}: refused: it points DCP at {relative!r}, "
                                        f"which is not a file of the checkpoint's folder")
        _refuse_links(file.parent / relative, file)


def _refuse_links(path: Path, metadata: Path) -> None:
    """Refuse ``path`` unless it is a regular file and no link: DCP opens what a link in
    a received checkpoint points at, any file on the machine. A missing file is left for
    DCP to report."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise CheckpointError(f"{metadata}: cannot read {path} ({e})") from e
    if not stat.S_ISREG(mode):
        kind = "a link" if stat.S_ISLNK(mode) else "not a regular file"
        raise UnsafeCheckpointError(f"{metadata}: refused: {path} is {kind}, which DCP "
                                    f"would follow out of the checkpoint's folder")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is read by :func:`read_metadata_safely`:
    pass it as ``storage_reader`` to ``dcp.load``, with :class:`SafeLoadPlanner` as its
    ``planner`` (:func:`safe_load` does both)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> "dcp_metadata.Metadata":
        metadata = read_metadata_safely(self.path, kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor entry (a step count, a learning rate,
    a string) is read with ``torch.load(weights_only=True)``: DCP's own reads it with a
    full unpickle, which runs whatever the checkpoint's bytes say."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"refused: the checkpoint entry {read_item.dest_index.fqn!r} does not load "
                f"with weights_only=True (a full unpickle would run code from it): "
                f"{refusal(e)}") from None
        if self.flatten_state_dict:  # where DefaultLoadPlanner puts it
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_load(state: Dict[str, Any], path: "str | os.PathLike", no_dist: bool = False) -> None:
    """``dcp.load(state, ...)`` of the checkpoint at ``path`` without running code from it
    (:class:`SafeFileSystemReader`, :class:`SafeLoadPlanner`); ``no_dist`` as there. An
    entry refused on some rank raises :class:`UnsafeCheckpointError` naming the checkpoint
    (DCP would raise its ``CheckpointException`` around it)."""
    read_metadata_safely(path)  # a refusal raised as it is, not inside DCP's errors
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)),
                 planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values()
                   if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise UnsafeCheckpointError(f"{path}: {refused[0]}") from None
        raise


__all__ = ["CheckpointError", "SafeFileSystemReader", "SafeLoadPlanner",
           "UnsafeCheckpointError", "read_metadata_safely", "safe_load"]
