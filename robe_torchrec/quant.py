"""Quantized ROBE-Z tables for inference: :class:`QuantRobeEmbeddingBagCollection`.

The ROBE array is stored as int8 in aligned chunks of ``quant_block_size`` floats, each with
its own scale and bias (``w ~ q * scale + bias``), or simply as float16. The forward
dequantizes the whole array and runs the float module's forward on it, so the output (a
``KeyedTensor`` with the float module's keys and layout) differs from the float module's only
by the quantization error. The array is small by design (that is ROBE's point), so
dequantizing it per call is cheap next to the lookup itself; nothing float is cached, which
keeps the memory saving.

TorchRec's ``quantize_inference_model`` swaps only the module types its mapping names, and
its default mapping does not name ROBE: ``quantize_inference_model(model)`` leaves every
``RobeEmbeddingBagCollection`` float, silently. Pass :func:`quantization_mapping`, or call
this module's :func:`quantize_inference_model`, which does and then checks with
:func:`check_quantized` that no float ROBE module is left.

Example::

    >>> from robe_torchrec import quant
    >>> qmodel = quant.quantize_inference_model(model)       # DLRM with ROBE and/or stock EBCs
    >>> # the same, with TorchRec's function:
    >>> from torchrec.inference.modules import quantize_inference_model
    >>> qmodel = quantize_inference_model(model, quantization_mapping=quant.quantization_mapping())
    >>> quant.check_quantized(qmodel)                        # raises if a float ROBE module is left
    >>> qebc = quant.QuantRobeEmbeddingBagCollection.from_float(ebc)   # one module
    >>> qebc(kjt).values().shape == ebc(kjt).values().shape
    True
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torch import nn
from torch.func import functional_call
from torchrec.inference.modules import DEFAULT_QUANT_MAPPING
from torchrec.inference.modules import quantize_inference_model as _torchrec_quantize
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from robe_torchrec.config import RobeConfig
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.layout import RobeLayout
from robe_torchrec.torchscript import NotScriptable

#: storage dtypes of the array
DTYPES = (torch.int8, torch.float16)
# what a quantization config's weight dtype means here
_DTYPE_OF = {torch.int8: torch.int8, torch.qint8: torch.int8, torch.quint8: torch.int8,
             torch.float16: torch.float16}
_INT8_LEVELS = 255  # int8 spans [-128, 127]
#: dtypes of the pooled output (``output_dtype``), as TorchRec's quantized EBC offers them
OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _storage_dtype(dtype: torch.dtype, what: str = "") -> torch.dtype:
    if dtype not in _DTYPE_OF:
        raise ValueError(f"QuantRobeEmbeddingBagCollection: cannot store a ROBE array as "
                         f"{dtype}{what}; use torch.int8 (or qint8 / quint8) or torch.float16")
    return _DTYPE_OF[dtype]


def _output_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"QuantRobeEmbeddingBagCollection: output_dtype {dtype} is not "
                         "supported; the pooled embeddings are float32, float16 or bfloat16")
    return dtype


def weight_dtype_of(module: RobeEmbeddingBagCollection, default: torch.dtype,
                    per_table: Optional[Dict[str, torch.dtype]]) -> torch.dtype:
    """The storage dtype of ``module``'s array: ``per_table[name]`` for each of its tables
    (``default`` for tables not named). A ROBE array is stored in one dtype for all the tables
    it holds (and a module's per-table arrays share one flat buffer), so they must agree."""
    per_table = per_table or {}
    wanted = {t.name: per_table.get(t.name, default) for t in module.embedding_bag_configs()}
    for name, dtype in wanted.items():
        _storage_dtype(dtype, f" (table {name!r})")
    stored = {name: _DTYPE_OF[dtype] for name, dtype in wanted.items()}
    if len(set(stored.values())) > 1:
        raise ValueError(
            "QuantRobeEmbeddingBagCollection stores a module's ROBE array(s) in one dtype, but "
            f"per_table_weight_dtype (with the default {default} for tables it does not name) "
            f"asks for {stored}; give every table of the module the same dtype, or put the "
            "tables that need another dtype in their own RobeEmbeddingBagCollection")
    return next(iter(stored.values()))


class QuantRobeEmbeddingBagCollection(NotScriptable, EmbeddingBagCollectionInterface):
    """A :class:`~robe_torchrec.RobeEmbeddingBagCollection` for inference, its array stored
    as int8 (per-block scale and bias) or float16; same input, output and layout.

    It holds no parameters (nothing to train): buffers ``qweight`` (the array, int8 or
    float16), ``scale`` and ``bias`` (int8 only, one per block) and ``robe_layout`` (checked
    on load as the float module does).

    Args:
        tables, robe, is_weighted: as for ``RobeEmbeddingBagCollection``.
        dtype: ``torch.int8`` or ``torch.float16``.
        quant_block_size: int8 only: floats per scale/bias, aligned chunks of the flat array
            (not ROBE's block size Z; ROBE's blocks start anywhere).
        scale_dtype: int8 only: ``torch.float32`` or ``torch.float16`` scale and bias.
        device: where the buffers live.

    Example::

        >>> qebc = QuantRobeEmbeddingBagCollection.from_float(ebc, dtype=torch.int8)
        >>> qebc.memory_bytes / (ebc.memory_size * 4)     # int8 + fp32 scale/bias per 64
        0.28125
        >>> with torch.no_grad():
        ...     pooled = qebc(kjt)                         # KeyedTensor, as ebc(kjt)
    """

    def __init__(self, tables: List[EmbeddingBagConfig], robe: RobeConfig,
                 is_weighted: bool = False, dtype: torch.dtype = torch.int8,
                 quant_block_size: int = 64, scale_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None,
                 output_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.output_dtype = _output_dtype(output_dtype)
        if dtype not in DTYPES:
            raise ValueError(f"QuantRobeEmbeddingBagCollection: dtype must be one of {DTYPES}, "
                             f"got {dtype}")
        if scale_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"QuantRobeEmbeddingBagCollection: scale_dtype must be float32 or "
                             f"float16, got {scale_dtype}")
        if quant_block_size < 1:
            raise ValueError(f"quant_block_size must be >= 1, got {quant_block_size}")
        # The float module on the meta device (it allocates nothing) is the forward we run on
        # the dequantized array: input checks, feature order and output stay the float
        # module's. Kept out of the module tree (a tuple), so it neither shows in state_dict
        # nor moves with .to(); its buffers, functions of the layout, live here instead and
        # are passed at each call.
        shell = RobeEmbeddingBagCollection(tables, robe, is_weighted, device="meta")
        self._shell = (shell,)
        layout = shell.layout
        # a normal tensor even under inference_mode (a serving process): the ops check
        # table_meta once per tensor version, which an inference tensor does not have
        with torch.inference_mode(False):
            meta = layout.table_meta(device=device)
        self.register_buffer("table_meta", meta, persistent=False)
        self.register_buffer("robe_layout", layout.to_tensor().to(device))
        unknown = {name for name, _ in shell.named_buffers()} - {"table_meta", "robe_layout"}
        if unknown:  # a new float-module buffer this module does not build yet
            raise NotImplementedError(f"QuantRobeEmbeddingBagCollection: cannot build the "
                                      f"float module's buffers {sorted(unknown)}")
        self.dtype, self.quant_block_size, self.scale_dtype = dtype, quant_block_size, scale_dtype
        size = layout.memory_size
        if dtype == torch.int8:
            blocks = -(-size // quant_block_size)
            self.register_buffer("qweight", torch.zeros(size, dtype=torch.int8, device=device))
            self.register_buffer("scale", torch.zeros(blocks, dtype=scale_dtype, device=device))
            self.register_buffer("bias", torch.zeros(blocks, dtype=scale_dtype, device=device))
        else:
            self.register_buffer("qweight", torch.zeros(size, dtype=torch.float16, device=device))

    def _apply(self, fn: Any, recurse: bool = True) -> "QuantRobeEmbeddingBagCollection":
        """``nn.Module._apply`` (``to``, ``cuda``...), making normal tensors under
        ``inference_mode`` too, as the constructor does (see there)."""
        with torch.inference_mode(False):
            return super()._apply(fn, recurse)

    @classmethod
    def from_float(cls, module: RobeEmbeddingBagCollection, dtype: Optional[torch.dtype] = None,
                   quant_block_size: int = 64, scale_dtype: torch.dtype = torch.float32,
                   output_dtype: Optional[torch.dtype] = None
                   ) -> "QuantRobeEmbeddingBagCollection":
        """Quantize a trained float module (what ``torch.ao.quantization.quantize_dynamic``
        and TorchRec's ``quantize_inference_model`` call).

        ``dtype`` ``None``: from ``module.qconfig`` if it has one (TorchRec's
        ``quantization_dtype``, then its ``per_table_weight_dtype`` for this module's tables,
        which must agree: see :func:`weight_dtype_of`; int8 / quint8 / qint8 -> int8,
        float16), else int8. ``output_dtype`` ``None``: the qconfig's activation dtype
        (TorchRec's ``output_dtype``), else float32. A value this module cannot honour is
        refused with ``ValueError``."""
        if not isinstance(module, RobeEmbeddingBagCollection):
            raise TypeError(f"QuantRobeEmbeddingBagCollection.from_float takes a "
                            f"RobeEmbeddingBagCollection, got {type(module).__name__}")
        qconfig = getattr(module, "qconfig", None)
        if dtype is None:
            default = qconfig.weight().dtype if qconfig is not None else torch.int8
            dtype = weight_dtype_of(module, default,
                                    getattr(qconfig, "per_table_weight_dtype", None))
        if output_dtype is None:
            activation = getattr(qconfig, "activation", None)
            output_dtype = activation().dtype if activation is not None else torch.float32
        layout = module.layout
        quant = cls(module.embedding_bag_configs(), layout.config, module.is_weighted(),
                    _storage_dtype(dtype), quant_block_size, scale_dtype, device=module.device,
                    output_dtype=output_dtype)
        quant.quantize_(module.weight.detach())
        return quant

    # --- the array -----------------------------------------------------------------------

    @torch.no_grad()
    def quantize_(self, weight: torch.Tensor) -> None:
        """Store the float array ``weight`` (in place)."""
        if weight.shape != self.qweight.shape:
            raise ValueError(f"expected a ROBE array of {self.qweight.numel()} floats, got "
                             f"shape {tuple(weight.shape)}")
        weight = weight.to(self.qweight.device, torch.float32)
        if self.dtype == torch.float16:
            self.qweight.copy_(weight)
            return
        blocks = self._blocks(weight)
        lo, hi = blocks.min(dim=1).values, blocks.max(dim=1).values
        # round scale and bias to their stored dtype first, so the codes are chosen for the
        # values dequantization will use
        scale = ((hi - lo) / _INT8_LEVELS).to(self.scale_dtype).float()
        bias = (lo + 128 * scale).to(self.scale_dtype).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant blocks: q = 0
        q = torch.round((blocks - bias[:, None]) / safe[:, None]).clamp_(-128, 127)
        self.qweight.copy_(q.flatten()[: self.qweight.numel()].to(torch.int8))
        self.scale.copy_(scale)
        self.bias.copy_(bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 array the forward looks up in."""
        if self.dtype == torch.float16:
            return self.qweight.float()
        blocks = self._blocks(self.qweight.float())
        out = blocks * self.scale.float()[:, None] + self.bias.float()[:, None]
        return out.flatten()[: self.qweight.numel()]

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as ``[blocks, quant_block_size]``, the last block padded with its last value
        (so the padding moves neither its minimum nor its maximum)."""
        pad = self.scale.numel() * self.quant_block_size - flat.numel()
        if pad:
            flat = torch.cat([flat, flat[-1:].expand(pad)])
        return flat.view(-1, self.quant_block_size)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the stored array with its scales and biases (not the small layout
        buffers); the float module holds ``memory_size * 4``."""
        held = [self.qweight] + ([self.scale, self.bias] if self.dtype == torch.int8 else [])
        return sum(t.numel() * t.element_size() for t in held)

    # --- EmbeddingBagCollection interface ------------------------------------------------

    @property
    def layout(self) -> RobeLayout:
        return self._shell[0].layout

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._shell[0].embedding_bag_configs()

    def is_weighted(self) -> bool:
        return self._shell[0].is_weighted()

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def memory_size(self) -> int:
        """Floats of the ROBE array (as the float module's ``memory_size``)."""
        return self.qweight.numel()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The float module's forward on the dequantized array."""
        tensors = {"weight": self.dequantize(), "table_meta": self.table_meta,
                   "robe_layout": self.robe_layout}
        pooled = functional_call(self._shell[0], tensors, (features,))
        if self.output_dtype == torch.float32:
            return pooled
        return KeyedTensor(keys=pooled.keys(), length_per_key=pooled.length_per_key(),
                           values=pooled.values().to(self.output_dtype))

    def extra_repr(self) -> str:
        scales = f", quant_block_size={self.quant_block_size}, scale_dtype={self.scale_dtype}" \
            if self.dtype == torch.int8 else ""
        output = f", output_dtype={self.output_dtype}" \
            if self.output_dtype != torch.float32 else ""
        return (f"tables={self.layout.table_names}, memory_size={self.memory_size}, "
                f"dtype={self.dtype}{scales}{output}")

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args,
                              **kwargs) -> None:
        saved = state_dict.get(prefix + "robe_layout")
        if saved is not None:
            self.layout.check_saved(saved)
            # the same layout, perhaps in an older format: this one is what the buffer holds
            state_dict[prefix + "robe_layout"] = self.layout.to_tensor()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def quantization_mapping() -> Dict[str, Type[nn.Module]]:
    """TorchRec's ``DEFAULT_QUANT_MAPPING`` plus ROBE's, for
    ``torchrec.inference.modules.quantize_inference_model(model, quantization_mapping=...)``.

    Example::

        >>> quantize_inference_model(model, quantization_mapping=quantization_mapping())
    """
    return {**DEFAULT_QUANT_MAPPING,
            torch.typename(RobeEmbeddingBagCollection): QuantRobeEmbeddingBagCollection}


def float_robe_modules(model: nn.Module) -> List[str]:
    """Paths of the float ``RobeEmbeddingBagCollection`` modules in ``model``."""
    return [name for name, m in model.named_modules()
            if isinstance(m, RobeEmbeddingBagCollection)]


def check_quantized(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``model`` still holds a float ROBE module, as TorchRec's
    ``quantize_inference_model`` leaves one when not given :func:`quantization_mapping`."""
    left = float_robe_modules(model)
    if left:
        raise ValueError(f"float RobeEmbeddingBagCollection modules were not quantized: {left}; "
                         "pass quantization_mapping=robe_torchrec.quant.quantization_mapping() "
                         "to torchrec's quantize_inference_model, or use "
                         "robe_torchrec.quant.quantize_inference_model")


def _table_names(model: nn.Module) -> List[str]:
    names = []
    for m in model.modules():
        for attr in ("embedding_bag_configs", "embedding_configs"):
            configs = getattr(m, attr, None)
            if callable(configs):
                names += [t.name for t in configs()]
    return names


def quantize_inference_model(model: nn.Module, **kwargs: Any) -> nn.Module:
    """TorchRec's ``quantize_inference_model`` (in place, ``kwargs`` passed on) with ROBE in
    the mapping (added to a ``quantization_mapping`` given), then :func:`check_quantized`.
    ``output_dtype``, ``quantization_dtype`` and ``per_table_weight_dtype`` apply to the ROBE
    modules as to TorchRec's, or are refused (a dtype a ROBE array cannot be stored in, tables
    of one ROBE module given different dtypes); ``per_table_weight_dtype`` naming a table the
    model does not have is refused too.

    Example::

        >>> qmodel = quantize_inference_model(model, quantization_dtype=torch.int8)
    """
    mapping = {**quantization_mapping(), **(kwargs.pop("quantization_mapping", None) or {})}
    per_table = kwargs.get("per_table_weight_dtype") or {}
    unknown = sorted(set(per_table) - set(_table_names(model)))
    if unknown:
        raise ValueError(f"per_table_weight_dtype names tables no embedding module of the model "
                         f"has: {unknown} (tables: {sorted(_table_names(model))})")
    model = _torchrec_quantize(model, quantization_mapping=mapping, **kwargs)
    check_quantized(model)
    return model


__all__ = ["DTYPES", "OUTPUT_DTYPES", "weight_dtype_of", "QuantRobeEmbeddingBagCollection", "check_quantized", "float_robe_modules",
           "quantization_mapping", "quantize_inference_model"]
