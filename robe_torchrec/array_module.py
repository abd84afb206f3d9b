"""What every ROBE module shares, whatever it returns: the array, its layout, the fused
optimizer, state-dict checks and input selection.

:class:`RobeArrayModule` is the base of :class:`~robe_torchrec.RobeEmbeddingBagCollection`
(pooled, ``KeyedTensor`` out) and :class:`~robe_torchrec.RobeEmbeddingCollection`
(unpooled, ``Dict[str, JaggedTensor]`` out). A subclass calls :meth:`_init_array` in its
constructor and :meth:`_run_lookup` in its forward; everything else (``weight``, ``layout``,
``reset_parameters``, ``fused_optimizer``, ``in_backward_optimizer``, the sizes, the
``robe_layout`` check on load) is written once here.

Example::

    >>> ec = RobeEmbeddingCollection(tables, RobeConfig(compression=100, block_size=4))
    >>> isinstance(ec, RobeArrayModule), ec.layout is ec.layout
    (True, True)
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from robe_torchrec.config import RobeConfig
from robe_torchrec.fused_lookup import autograd_anchor, fused_lookup
from robe_torchrec.layout import RobeLayout
from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.ops.deferred_checks import DeferredCheckError
from robe_torchrec.ops.feature_names import name_features, with_names
from robe_torchrec.optim import RobeFusedOptimizer
from robe_torchrec.rowwise_install import ArrayOwner
from robe_torchrec.torchscript import NotScriptable


#: the attribute of an array that holds its fused optimizer, for every module sharing it
_ARRAY_OPTIMIZER = "_robe_fused_optimizer"


class RobeArrayModule(NotScriptable, ArrayOwner):
    """The ROBE array of a module and what goes with it (see the module docstring).

    Attributes:
        weight: the flat ROBE array(s), ``layout.memory_size`` floats.
        table_meta: the ops' per-feature metadata (a function of the layout; not saved).
        robe_layout: the layout as a tensor, saved and checked on load.
    """

    weight: nn.Parameter
    table_meta: torch.Tensor
    robe_layout: torch.Tensor

    def _init_array(self, tables: Sequence[Any], robe: RobeConfig,
                    device: Optional[torch.device | str]) -> None:
        """Build the layout, the array and its buffers, and draw the array."""
        self._layout = RobeLayout.build(tables, robe)
        for table in tables:  # TorchRec's convention, which the layout followed
            if not table.feature_names:
                table.feature_names = [table.name]
        self.weight = nn.Parameter(torch.empty(self._layout.memory_size, device=device,
                                               dtype=self._layout.weight_dtype))
        # both buffers are functions of the layout: reset_parameters() rebuilds them after
        # to_empty(), as it re-draws the weight. table_meta is a normal tensor even in a
        # module built under inference_mode: the ops check it once per tensor version, and an
        # inference tensor, which has none, would be copied to the host and checked at every
        # call (on a GPU, a wait for the device each time)
        with torch.inference_mode(False):
            meta = self._layout.table_meta(device=self.weight.device)
        self.register_buffer("table_meta", meta, persistent=False)
        self.register_buffer("robe_layout", self._layout.to_tensor(), persistent=True)
        name_features(self.table_meta, self._layout.feature_names)
        self._fused: Optional[RobeFusedOptimizer] = None
        #: what apply_optimizer_in_backward recorded on the array when _fused was built
        self._applied: List[Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]] = []
        #: the array's requires_grad was turned off here, for a compiled graph (see
        #: _sync_fused_optimizer); otherwise off means the user froze the array
        self._grad_off_for_compile = False
        self._anchor = autograd_anchor(self.weight.device)  # what fused_lookup needs
        # lets torchrec.optim.RowWiseAdagrad tell the array from a table (rowwise_install)
        self.register_array()
        self.reset_parameters()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def layout(self) -> RobeLayout:
        """Where every table and feature lives (immutable, built once from the tables and
        the :class:`RobeConfig`); the sharder and the sharded lookups read it too."""
        return self._layout

    def reset_parameters(self) -> None:
        """Draw the array uniform in ``[-s, s]``, ``s = layout.init_scale`` (``robe.init_scale``,
        else ``sqrt(1 / max num_embeddings)``), or as its tables' ``weight_init_min`` /
        ``weight_init_max`` or ``init_fn`` say (:mod:`robe_torchrec.table_init`), and rebuild
        the layout buffers.

        As for TorchRec's modules, a module built on the meta device is materialised with
        ``to_empty`` and then this (it draws exactly what construction on the device draws)::

            >>> ebc = RobeEmbeddingBagCollection(tables, robe, device="meta")
            >>> ebc.to_empty(device="cpu")
            >>> torch.manual_seed(0); ebc.reset_parameters()   # == built on CPU after manual_seed(0)

        An optimizer applied in backward on the meta device stays applied, to the new array
        (see :meth:`_apply`): the module then trains as one built on CPU.
        """
        self._restore_layout_buffers()
        if self.weight.device.type != "meta":
            self._layout.draw(self.weight)

    def _restore_layout_buffers(self) -> None:
        with torch.no_grad():
            self.table_meta.copy_(self._layout.table_meta())
            self.robe_layout.copy_(self._layout.to_tensor())

    def _run_lookup(self, args: LookupArgs, features: KeyedJaggedTensor) -> torch.Tensor:
        """``robe::forward`` of ``args`` on the array, through the fused optimizer once one
        was applied (unless the array was frozen); op errors are restated in the input's
        terms."""
        fused = self._current_fused_optimizer()
        try:
            if fused is None or self._frozen():
                return args.forward(self.weight)
            return fused_lookup(self.weight, fused, args, self._anchor)
        except (ValueError, RuntimeError) as err:
            raise self._explain(err, features) from None

    # --- fused optimizer -----------------------------------------------------------------

    @property
    def fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        """The in-backward optimizer, once ``apply_optimizer_in_backward`` was called on
        :attr:`weight` (``None`` while training on dense gradients)."""
        return self._current_fused_optimizer()

    def in_backward_optimizer(self) -> Optional[Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]]:
        """``(optimizer class, kwargs)`` that ``apply_optimizer_in_backward`` recorded on
        :attr:`weight`, or ``None``; raises if more than one was applied."""
        classes = getattr(self.weight, "_optimizer_classes", None)
        if not classes:
            return None
        if len(classes) != 1:
            raise ValueError(f"{type(self).__name__}: exactly one in-backward optimizer "
                             f"per ROBE array is supported, got {len(classes)}")
        return classes[0], dict(self.weight._optimizer_kwargs[0])  # type: ignore[attr-defined]

    def _frozen(self) -> bool:
        """Whether the user froze the array (``requires_grad_(False)`` on it or on a module
        holding it): its in-backward optimizer then leaves it alone, as a stock table's
        does, whose optimizer runs on a gradient a frozen table never gets."""
        return not self.weight.requires_grad and not self._grad_off_for_compile

    def _current_fused_optimizer(self) -> Optional[RobeFusedOptimizer]:
        # first, before a compiled graph reads the weight: the sync may turn its
        # requires_grad off, and the graph must take the array as it is then
        if not self._sync_fused_optimizer():
            return None
        # a compiled graph guards on the attribute apply_optimizer_in_backward sets on the
        # weight: applying one later recompiles (the sync refused more than one)
        if not getattr(self.weight, "_optimizer_classes", None):
            return None
        return self._fused

    # torch.compile cannot trace the construction of an optimizer; marked constant, this
    # runs for real when a graph is traced (before the graph reads self._fused), and as a
    # plain call in eager mode
    @torch.compiler.assume_constant_result
    def _sync_fused_optimizer(self) -> bool:
        """Create (or replace) the fused optimizer after ``apply_optimizer_in_backward``. The
        fused backward updates the array and no gradient ever reaches it (see
        :mod:`robe_torchrec.fused_lookup`); for a graph ``torch.compile`` traces, the array
        is also taken out of autograd, as FBGEMM's fused tables are, since AOTAutograd
        refuses to write in backward to an input that requires grad (pytorch#178622). In
        eager mode its ``requires_grad`` stays the user's: off means frozen.
        ``False`` while torchrec.fx traces an inference graph (the weight is a Proxy)."""
        weight = self.weight
        if isinstance(weight, torch.fx.Proxy):
            return False
        # runs before every eager forward: the recorded classes are read without copying
        # the kwargs, which only a new optimizer needs
        classes = getattr(weight, "_optimizer_classes", None)
        if classes:
            if len(classes) != 1 or self._fused is None or self._fused.param is not weight \
                    or self._fused.optimizer_class is not classes[0]:
                optimizer_class, kwargs = self.in_backward_optimizer()  # raises for several
                self._fused = self._array_optimizer(optimizer_class, kwargs)
                self._applied = self._recorded_in_backward()
            if weight.requires_grad and torch.compiler.is_compiling():
                weight.requires_grad_(False)
                self._grad_off_for_compile = True
        return True

    def _array_optimizer(self, optimizer_class: Type[torch.optim.Optimizer],
                         kwargs: Dict[str, Any]) -> RobeFusedOptimizer:
        """The fused optimizer of :attr:`weight`: the one another module sharing the array
        (``b.weight = a.weight``) made already, so that one state steps it, as one
        parameter has one in-backward optimizer; else a new one, kept on the array."""
        weight = self.weight
        shared = getattr(weight, _ARRAY_OPTIMIZER, None)
        if shared is not None and shared.param is weight \
                and shared.optimizer_class is optimizer_class \
                and shared.block_size == self._layout.block_size:
            return shared
        fused = RobeFusedOptimizer("weight", weight, optimizer_class, kwargs,
                                   block_size=self._layout.block_size)
        setattr(weight, _ARRAY_OPTIMIZER, fused)
        _take_over_from_pytorch(weight, fused)
        _list_in_backward(weight, fused)
        return fused

    # --- moves and casts: the in-backward optimizer stays with the array ------------------

    def _apply(self, fn: Any, recurse: bool = True) -> "RobeArrayModule":
        """``nn.Module._apply`` (``to_empty``, ``to``, ``cuda``, ``half``...), keeping the
        in-backward optimizer on the array.

        ``to_empty`` from the meta device (and any move under torch's
        ``overwrite_module_params_on_conversion``) puts a new tensor in place of
        :attr:`weight`: what ``apply_optimizer_in_backward`` recorded on the old one would be
        lost, and the module would then train on dense gradients that no optimizer applies,
        silently. It is recorded again on the new array, as on an array built on its device,
        and the fused optimizer follows it.

        The layout buffers, functions of the layout, are rebuilt when they leave the meta
        device: ``to_empty`` alone then gives a module whose lookups run (on an array not
        drawn yet, as a stock module's tables would be) instead of one whose first forward
        fails on uninitialised ``table_meta`` entries. A move under ``inference_mode`` (a
        serving process loading its model) makes normal tensors, as in the constructor.
        """
        applied = self._recorded_in_backward()
        fused, frozen = self._fused, self._frozen()
        buffers_on_meta = self.table_meta.is_meta
        with torch.inference_mode(False):
            module = super()._apply(fn, recurse)
        if buffers_on_meta and not self.table_meta.is_meta:
            self._restore_layout_buffers()
        name_features(self.table_meta, self._layout.feature_names)  # a new tensor, perhaps
        self._follow_new_array(applied, fused, frozen)
        return module

    def __getstate__(self) -> Dict[str, Any]:
        """The module's state for a copy or a pickle, with what ``apply_optimizer_in_backward``
        recorded on :attr:`weight` even before a forward made the fused optimizer: the copy's
        new array lacks it (see :meth:`__setstate__`)."""
        state = dict(self.__dict__)
        state["_applied"] = self._recorded_in_backward() or self._applied
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """A deep copy (or an unpickled module) has a new array, without what
        ``apply_optimizer_in_backward`` recorded on the old one (``Parameter.__deepcopy__``
        keeps none of it): recorded again from the module's own record, so the copy trains
        with its copy of the fused optimizer instead of not at all (no gradient reaches its
        array), frozen if the original was."""
        super().__setstate__(state)
        self.__dict__.setdefault("_grad_off_for_compile", False)  # pickled before it existed
        self._follow_new_array(self._applied, self._fused, self._frozen())

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args, **kwargs) -> None:
        # load_state_dict(assign=True) puts the saved tensor in place of the array, as
        # _apply may: keep the in-backward optimizer the same way
        applied, fused, frozen = self._recorded_in_backward(), self._fused, self._frozen()
        self._load_checked(state_dict, prefix, *args, **kwargs)
        self._follow_new_array(applied, fused, frozen)

    def _recorded_in_backward(self) -> List[Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]]:
        """Every ``(optimizer class, kwargs)`` that ``apply_optimizer_in_backward`` recorded on
        :attr:`weight`, the very kwargs dicts (a sharder may edit a shared one later)."""
        return list(zip(getattr(self.weight, "_optimizer_classes", []),
                        getattr(self.weight, "_optimizer_kwargs", [])))

    def _follow_new_array(self, applied: List[Tuple[Type[torch.optim.Optimizer], Dict[str, Any]]],
                          fused: Optional[RobeFusedOptimizer], frozen: bool) -> None:
        """After :attr:`weight` may have been replaced: record ``applied`` on it again if it
        lost them, rebuild the fused optimizer ``fused`` on it if it was the old array's,
        and keep it ``frozen`` if the old one was."""
        if self._anchor.device != self.weight.device:
            self._anchor = autograd_anchor(self.weight.device)
        if applied and not getattr(self.weight, "_optimizer_classes", None):
            # it reaches the array's gradient accumulator through autograd, which a caller's
            # no_grad (torchrec's init_parameters) or requires_grad=False would turn off; a
            # compiled graph's sync takes the array out of autograd again
            self.weight.requires_grad_(True)
            self._grad_off_for_compile = False
            with torch.enable_grad():
                for optimizer_class, kwargs in applied:
                    # what torchrec.optim.apply_optimizer_in_backward runs (deprecated for it)
                    _apply_optimizer_in_backward(optimizer_class, [self.weight], kwargs)
            if frozen:
                self.weight.requires_grad_(False)
        if fused is None or fused.param is self.weight:
            if fused is not None:  # a copy's: its array has PyTorch's own in the list again
                _list_in_backward(self.weight, fused)
            return
        self._fused = None
        self._sync_fused_optimizer()
        if self._fused is not None:
            _carry_fused_state(fused, self._fused)

    # --- size and layout -----------------------------------------------------------------

    @property
    def memory_size(self) -> int:
        """Floats held by the ROBE array(s)."""
        return self.weight.numel()

    @property
    def uncompressed_size(self) -> int:
        """Floats the tables would hold uncompressed (sum of num_embeddings * embedding_dim)."""
        return self._layout.uncompressed_size

    @property
    def compression_ratio(self) -> float:
        return self._layout.uncompressed_size / self.memory_size

    def extra_repr(self) -> str:
        layout = self._layout
        return (f"tables={layout.table_names}, "
                f"memory_size={self.memory_size}, compression={self.compression_ratio:.1f}x, "
                f"block_size={layout.block_size}, hash={layout.hash_mode.name.lower()}, "
                f"shared={layout.shared}")

    def _load_checked(self, state_dict: Dict[str, Any], prefix: str, *args, **kwargs) -> None:
        """``nn.Module._load_from_state_dict`` after the ``robe_layout`` check."""
        saved = state_dict.get(prefix + "robe_layout")
        if saved is not None:
            self._layout.check_saved(saved)
            # the same layout, perhaps in an older format: this one is what the buffer holds
            state_dict[prefix + "robe_layout"] = self._layout.to_tensor()
        elif prefix + "weight" in state_dict:
            # Without the layout nothing says the array means the same embeddings: refused
            # before anything is copied, whatever `strict` (torch hands every module
            # strict=True here and applies the caller's only to the key lists afterwards).
            raise ValueError(
                f"{type(self).__name__}: the state dict has {prefix}weight but no "
                f"{prefix}robe_layout, so the array's layout cannot be checked (another "
                "layout would scramble every embedding); load a state dict saved with its "
                f"robe_layout, or, if you know the array has this module's layout, add "
                f"state_dict['{prefix}robe_layout'] = module.robe_layout")
        # after to_empty() the non-persistent table_meta is garbage and no checkpoint has it
        self._restore_layout_buffers()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # --- errors -------------------------------------------------------------------------

    def _explain(self, err: Exception, features: KeyedJaggedTensor) -> Exception:
        """The op's error in the input's terms: the feature's name next to its index (where
        the op has not named it: checks run outside an op), and the lengths the caller gave
        rather than the offsets computed from them."""
        if isinstance(err, DeferredCheckError):
            return err  # another call's input, perhaps another module's: named by that call
        message = with_names(str(err), None, tuple(self._layout.feature_names))
        if features.lengths_or_none() is not None:  # its offsets are their cumulative sum
            message = re.sub(r"offsets\[-1\] = (\d+) but values has (\d+) entries \(.*?\)",
                             r"lengths sum to \1 but values has \2 entries", message)
        return type(err)(message)


def _carry_fused_state(old: RobeFusedOptimizer, new: RobeFusedOptimizer) -> None:
    """Give ``new`` (just built on the new array) the hyper-parameters and state of ``old``
    (the old array's), except state on the meta device: a module built there never trained,
    so ``new``'s fresh state is the right one, as for a module built on its device."""
    for key, value in old.param_groups[0].items():
        if key != "params":
            new.param_groups[0][key] = value
    state = new.param_state
    for key, value in old.param_state.items():
        if key in state and not value.is_meta:
            state[key] = value  # converted to the array's device and dtype at the next step


def _list_in_backward(weight: torch.Tensor, fused: RobeFusedOptimizer) -> None:
    """Put ``fused`` where ``torch.distributed.optim._get_in_backward_optimizers``
    (checkpoints, schedulers) finds a parameter's in-backward optimizer, in place of the one
    PyTorch made, as TorchRec's sharded tables put theirs."""
    weight._in_backward_optimizers = [fused]  # type: ignore[attr-defined]


def _take_over_from_pytorch(weight: torch.Tensor, fused: RobeFusedOptimizer) -> None:
    """Give ``fused`` the hyper-parameters and state of the optimizer of its class that
    ``apply_optimizer_in_backward`` made for ``weight``, which ``fused`` replaces: a
    scheduler may have set its rate before the first forward, and a traced graph's backward
    (which runs without the fused optimizer) may have stepped it."""
    for own in getattr(weight, "_in_backward_optimizers", []):
        if type(own) is not fused.optimizer_class:
            continue
        group, source = fused.param_groups[0], own.param_groups[0]
        for key in group:
            if key != "params" and key in source:
                group[key] = source[key]
        state = fused.param_state
        for key, value in own.state.get(weight, {}).items():
            if key in state and torch.is_tensor(value) and value.shape == state[key].shape:
                state[key] = value  # converted to the array's device and dtype at the next step


# --- input handling ------------------------------------------------------------------------

def as_kjt(features: Any) -> Any:
    """A ``TensorDict`` of jagged (nested) tensors, one a feature, as the
    ``KeyedJaggedTensor`` TorchRec's embedding modules make of it (``maybe_td_to_kjt``, its
    keys in its order); anything else as it is (a KJT, or a tracer's proxy of one)."""
    return maybe_td_to_kjt(features, None)


def check_kjt(features: Any, owner: str) -> KeyedJaggedTensor:
    """``features`` if it is a ``KeyedJaggedTensor``, else ``TypeError`` naming ``owner``
    (a ``TensorDict`` is converted before, by :func:`as_kjt`)."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{owner} expects a KeyedJaggedTensor (or a TensorDict of jagged "
                        f"tensors), got {type(features).__name__}")
    return features


def select_features(features: KeyedJaggedTensor, feature_names: List[str],
                    owner: str = "RobeEmbeddingBagCollection") -> KeyedJaggedTensor:
    """``features`` reduced to ``feature_names``, in that order; other keys are dropped (as
    TorchRec's embedding modules drop them), a missing one raises ``ValueError`` naming it,
    and so does a key given twice (which of its two inputs to look up is anyone's guess:
    TorchRec's modules take the last, silently).

    Example::

        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     keys=["other", "f1"], values=torch.tensor([7, 1, 2]), lengths=torch.tensor([1, 2]))
        >>> select_features(kjt, ["f1"]).keys()
        ['f1']
    """
    keys = features.keys()
    if keys == feature_names:  # the usual case: no copy, no read of the lengths
        return features
    missing = [f for f in feature_names if f not in keys]
    if missing:
        # an unknown key next to a missing one is likely a typo of it: name both
        unknown = [k for k in keys if k not in feature_names]
        also = f", unknown {unknown}" if unknown else ""
        raise ValueError(f"{owner}: the input lacks features of the tables: "
                         f"missing {missing}{also} (expected {feature_names}; unknown "
                         "features are ignored)")
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"{owner}: the input has features {twice} more than once (keys "
                         f"{keys}); give each feature once, its ids in one place")
    order = [keys.index(f) for f in feature_names]
    selected = features.permute(order)
    weights = features.weights_or_none()
    if weights is None or not weights.requires_grad:
        return selected
    return _with_weights(selected, _weights_in_order(weights, features.length_per_key(), order))


def _weights_in_order(weights: torch.Tensor, length_per_key: List[int],
                      order: List[int]) -> torch.Tensor:
    """The per-sample weights of the keys ``order`` picks, key after key: cut by key and
    joined, which autograd differentiates whatever the order. ``KeyedJaggedTensor.permute``
    passes their gradient back wrongly (torchrec 1.8, fbgemm 1.8): none for a variable batch
    per feature, a wrong shape for a subset of the keys, and reads out of its tensors for a
    key taken twice (a feature shared by two tables); TorchRec's ``EmbeddingBagCollection``
    cuts its input by key too (``to_dict``)."""
    by_key = weights.split(length_per_key)
    return torch.cat([by_key[i] for i in order])


def _with_weights(features: KeyedJaggedTensor, weights: torch.Tensor) -> KeyedJaggedTensor:
    """``features`` with other per-sample weights (ids, lengths, strides and inverse indices
    kept)."""
    variable = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=features.keys(), values=features.values(), weights=weights,
        lengths=features.lengths(),
        stride=None if variable else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        inverse_indices=features.inverse_indices_or_none())
