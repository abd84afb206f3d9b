"""The training app's typed config: one dataclass per option of each config group, registered
in Hydra's ConfigStore, so that Hydra checks ``configs/`` and every override against it while
it composes. A typo'd key or a value of the wrong type stops there, with Hydra's message
naming the key (``full_key: run.steps``).

Each YAML of ``configs/`` extends its schema in its defaults list
(``- /schema/embedding/robe@_here_``); the root ``configs/config.yaml`` extends
``/schema/app``. The values and their comments live in the YAML files only: every schema
field is ``MISSING`` here, so a key the YAML leaves out is reported, not silently defaulted.

The rules of the app's own options (choices of names, counts that must be positive, which
``run`` settings go together) are each schema's ``__post_init__``, run by :func:`typed`. What
the app hands to a lower layer is checked by that layer once: ROBE's settings by
:class:`robe_torchrec.RobeConfig`, the model's by :class:`robe_torchrec.dlrm.DLRMSpec`
(:mod:`robe_torchrec.train.config` builds them and reports their errors).

Example::

    >>> register()                      # once, before Hydra composes configs/config.yaml
    >>> app = typed(cfg)                # AppConfig; raises ConfigError naming the key
    >>> app.embedding.block_size, type(app.data).__name__
    (8, 'SyntheticDataConfig')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Type

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue


class ConfigError(ValueError):
    """A setting of the training config is invalid (the message names the key)."""


def _choice(value: Any, allowed: Sequence[str], key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; choose one of {', '.join(allowed)}")


def _at_least(obj: Any, group: str, minimum: int, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value < minimum:
            raise ConfigError(f"{group}.{key} must be >= {minimum}, got {value}")


@dataclass
class Option:
    """One option of a config group: ``KEY`` (``name``, or ``kind`` for ``embedding``) holds
    the option's name, so a schema refuses a config that names another option."""

    GROUP: ClassVar[str] = ""
    KEY: ClassVar[str] = "name"
    #: the option's name ("" in the group's base schema)
    OPTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not self.OPTION:
            return
        value = getattr(self, self.KEY)
        choices = options(self.GROUP)
        _choice(value, choices, f"{self.GROUP}.{self.KEY}")
        if value != self.OPTION:
            # a schema checks only its own keys: pick the option whose keys those are
            raise ConfigError(f"{self.GROUP}.{self.KEY}={value} does not match the "
                              f"{self.GROUP}={self.OPTION} config it is set in; choose the "
                              f"option with {self.GROUP}={value}")


# -- run ----------------------------------------------------------------------------------

@dataclass
class RunConfig:
    """``configs/run/default.yaml``: steps, batches, checkpoints, the non-finite guard,
    serving (the YAML says what each key does)."""

    steps: int = MISSING
    batch_size: int = MISSING
    seed: int = MISSING
    log_every: int = MISSING
    eval_every: int = MISSING
    eval_batches: int = MISSING
    test_batches: int = MISSING
    checkpoint_every: int = MISSING
    keep_checkpoints: int = MISSING
    #: auto | true | false: a string, since ``run.resume=true`` on the command line is a bool
    resume: str = MISSING
    existing_checkpoints: str = MISSING
    allow_unverified: bool = MISSING
    on_nonfinite: str = MISSING
    check_every: int = MISSING
    max_rollbacks: int = MISSING
    rollback_lr_scale: float = MISSING
    progress_bar: bool = MISSING
    tensorboard: bool = MISSING
    threads: Optional[int] = MISSING
    device: str = MISSING
    collective_timeout: float = MISSING
    mode: str = MISSING
    checkpoint: Optional[str] = MISSING
    predictions: bool = MISSING
    export: Optional[str] = MISSING

    def __post_init__(self) -> None:
        _at_least(self, "run", 1, "steps", "batch_size")
        _at_least(self, "run", 0, "log_every", "eval_every", "checkpoint_every",
                  "eval_batches", "test_batches", "check_every", "max_rollbacks")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"run.keep_checkpoints must be >= 0, got "
                              f"{self.keep_checkpoints} (0 keeps every checkpoint)")
        if self.resume.lower() not in ("auto", "true", "false"):
            raise ConfigError(f"run.resume must be auto, true or false, got {self.resume!r}")
        _choice(self.existing_checkpoints, ("refuse", "move"), "run.existing_checkpoints")
        _choice(self.on_nonfinite, ("stop", "rollback"), "run.on_nonfinite")
        if not 0 < self.rollback_lr_scale < 1:
            raise ConfigError(f"run.rollback_lr_scale must be in (0, 1) (the learning rates are "
                              f"multiplied by it on each rollback), got {self.rollback_lr_scale}")
        if not self.collective_timeout > 0:
            raise ConfigError(f"run.collective_timeout must be a number of seconds > 0, got "
                              f"{self.collective_timeout}")
        _choice(self.mode, ("train", "eval"), "run.mode")
        if self.mode == "eval" and not self.checkpoint:
            raise ConfigError("run.mode=eval needs run.checkpoint=<run dir>/checkpoints/step_N")
        if self.mode != "eval" and self.checkpoint:
            raise ConfigError(f"run.checkpoint is read by run.mode=eval only (got run.mode="
                              f"{self.mode}; run.resume continues training from the run dir's "
                              f"checkpoints)")
        if self.predictions and self.mode != "eval":
            raise ConfigError("run.predictions=true needs run.mode=eval")


# -- data ---------------------------------------------------------------------------------

@dataclass
class DataConfig(Option):
    """The ``data`` group: where the batches come from (``configs/data/``)."""

    GROUP: ClassVar[str] = "data"
    name: str = MISSING


@dataclass
class SyntheticDataConfig(DataConfig):
    OPTION: ClassVar[str] = "synthetic"
    #: the choices of robe_torchrec.data.synthetic.MODES (the app offers both)
    MODES: ClassVar[Sequence[str]] = ("realistic", "hard")

    mode: str = MISSING
    cardinality_scale: float = MISSING
    num_sparse: int = MISSING
    seed: int = MISSING
    cycle: int = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice(self.mode, self.MODES, "data.mode")
        if not self.cardinality_scale > 0:
            raise ConfigError(f"data.cardinality_scale must be > 0 (it multiplies the Criteo "
                              f"table sizes), got {self.cardinality_scale}")
        _at_least(self, "data", 0, "cycle")


@dataclass
class CriteoDataConfig(DataConfig):
    """What both Criteo readers take: the splits' files and the tables' sizes."""

    #: a path or a list of paths (npy: file prefixes)
    train: Any = MISSING
    val: Any = MISSING
    test: Any = MISSING
    #: one hash size for every table, or one row count per table
    num_embeddings_per_feature: Any = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        train = self.train
        if not train or not (isinstance(train, str) or all(isinstance(p, str) for p in train)):
            raise ConfigError(f"data.train is required (a path or a list of paths), got "
                              f"{train!r}")
        sizes = self.num_embeddings_per_feature
        if isinstance(sizes, bool) or not (
                isinstance(sizes, int) or (sizes and all(isinstance(n, int) for n in sizes))):
            raise ConfigError(f"data.num_embeddings_per_feature is required (one hash size, or "
                              f"one row count per table): the tables are built from it, got "
                              f"{sizes!r}")


@dataclass
class CriteoTsvDataConfig(CriteoDataConfig):
    OPTION: ClassVar[str] = "criteo_tsv"
    #: checked by robe_torchrec.data.criteo_tsv.CriteoTsv, which owns the choices
    on_bad_row: str = MISSING


@dataclass
class CriteoNpyDataConfig(CriteoDataConfig):
    OPTION: ClassVar[str] = "criteo_npy"
    split_eval_prefix: bool = MISSING
    mmap_mode: bool = MISSING
    check_values: bool = MISSING


# -- embedding ----------------------------------------------------------------------------

@dataclass
class EmbeddingConfig(Option):
    """The ``embedding`` group: ROBE-Z or TorchRec's full tables."""

    GROUP: ClassVar[str] = "embedding"
    KEY: ClassVar[str] = "kind"
    kind: str = MISSING
    dim: int = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, "embedding", 1, "dim")


@dataclass
class RobeEmbeddingConfig(EmbeddingConfig):
    """The keys of :class:`robe_torchrec.RobeConfig`, which checks them (once, there), and
    ``init_from``."""

    OPTION: ClassVar[str] = "robe"
    compression: Optional[float] = MISSING
    memory_size: Optional[int] = MISSING
    block_size: int = MISSING
    hash: str = MISSING
    bounds_check: str = MISSING
    seed: int = MISSING
    shared: bool = MISSING
    #: a checkpoint directory of an embedding=full run
    init_from: Optional[str] = MISSING


@dataclass
class FullEmbeddingConfig(EmbeddingConfig):
    OPTION: ClassVar[str] = "full"


# -- model --------------------------------------------------------------------------------

@dataclass
class ModelConfig(Option):
    """The ``model`` group; :class:`robe_torchrec.dlrm.DLRMSpec` checks the layer sizes."""

    GROUP: ClassVar[str] = "model"
    name: str = MISSING
    dense_arch_layer_sizes: List[int] = MISSING
    over_arch_layer_sizes: List[int] = MISSING


@dataclass
class DLRMModelConfig(ModelConfig):
    OPTION: ClassVar[str] = "dlrm"
    fast_interaction: bool = MISSING


@dataclass
class DCNModelConfig(ModelConfig):
    OPTION: ClassVar[str] = "dcn"
    dcn_num_layers: int = MISSING
    dcn_low_rank_dim: int = MISSING


# -- optimizer ----------------------------------------------------------------------------

@dataclass
class OptimizerConfig(Option):
    """The ``optimizer`` group: the embeddings' (fused into backward) and the dense layers'
    optimizer, one kind with two learning rates."""

    GROUP: ClassVar[str] = "optimizer"
    name: str = MISSING
    embedding_lr: float = MISSING
    dense_lr: float = MISSING
    weight_decay: float = MISSING


@dataclass
class SGDConfig(OptimizerConfig):
    OPTION: ClassVar[str] = "sgd"


@dataclass
class AdagradConfig(OptimizerConfig):
    OPTION: ClassVar[str] = "adagrad"
    eps: float = MISSING


@dataclass
class AdamConfig(OptimizerConfig):
    OPTION: ClassVar[str] = "adam"
    betas: List[float] = MISSING
    eps: float = MISSING


# -- pipeline, sharding ---------------------------------------------------------------------

@dataclass
class PipelineConfig:
    """Every option of the ``pipeline`` group: a name of
    ``robe_torchrec.pipelines.make_pipeline`` and its keyword arguments (checked by it)."""

    NAMES: ClassVar[Sequence[str]] = ("plain", "sparse_dist", "fused_sparse_dist", "semi_sync")
    name: str = MISSING
    options: Dict[str, Any] = MISSING

    def __post_init__(self) -> None:
        _choice(self.name, self.NAMES, "pipeline.name")


@dataclass
class ShardingConfig:
    """Every option of the ``sharding`` group: the sharding types the planner may use
    (null: any)."""

    TYPES: ClassVar[Sequence[str]] = ("data_parallel", "table_wise", "row_wise", "column_wise",
                                      "table_row_wise")
    types: Optional[List[str]] = MISSING

    def __post_init__(self) -> None:
        for t in self.types or []:
            _choice(t, self.TYPES, "sharding.types")


# -- the whole config ---------------------------------------------------------------------

@dataclass
class AppConfig:
    """``configs/config.yaml``: one option of each group."""

    run: RunConfig = MISSING
    data: DataConfig = MISSING
    embedding: EmbeddingConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    pipeline: PipelineConfig = MISSING
    sharding: ShardingConfig = MISSING


#: group -> its schema(s): one per option (by name), or one for every option of the group
SCHEMAS: Dict[str, "Type | Dict[str, Type]"] = {
    "run": RunConfig,
    "data": {c.OPTION: c for c in (SyntheticDataConfig, CriteoTsvDataConfig,
                                   CriteoNpyDataConfig)},
    "embedding": {c.OPTION: c for c in (RobeEmbeddingConfig, FullEmbeddingConfig)},
    "model": {c.OPTION: c for c in (DLRMModelConfig, DCNModelConfig)},
    "optimizer": {c.OPTION: c for c in (SGDConfig, AdagradConfig, AdamConfig)},
    "pipeline": PipelineConfig,
    "sharding": ShardingConfig,
}


def options(group: str) -> List[str]:
    """The option names of a group whose options have schemas of their own."""
    schemas = SCHEMAS[group]
    return list(schemas) if isinstance(schemas, dict) else []


def register() -> None:
    """Store the schemas in Hydra's ConfigStore, where the YAML files' defaults lists find
    them: ``/schema/app``, ``/schema/<group>`` (one schema for the group) and
    ``/schema/<group>/<option>``. Call it before Hydra composes; calling it again is
    harmless."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="schema", name="app", node=AppConfig, provider="robe_torchrec")
    for group, schemas in SCHEMAS.items():
        if isinstance(schemas, dict):
            for option, schema in schemas.items():
                store.store(group=f"schema/{group}", name=option, node=schema,
                            provider="robe_torchrec")
        else:
            store.store(group="schema", name=group, node=schemas, provider="robe_torchrec")


def typed(cfg: DictConfig) -> AppConfig:
    """``cfg`` (a composed config) as its dataclasses, each one's ``__post_init__`` run: the
    first invalid setting raises :class:`ConfigError`, naming the key."""
    if OmegaConf.get_type(cfg) is not AppConfig:
        raise ConfigError("the config is not typed: the defaults list of config.yaml must "
                          "start with /schema/app@_here_ (see the shipped configs/config.yaml), "
                          "and robe_torchrec.train.schema.register() must run before Hydra "
                          "composes")
    for group, schemas in SCHEMAS.items():
        # config.yaml's schema types each group by its base only: an option's own keys and
        # rules need the option's schema
        if isinstance(schemas, dict) and OmegaConf.get_type(cfg, group) not in schemas.values():
            option = cfg[group].get(schemas[next(iter(schemas))].KEY)
            raise ConfigError(f"{group}: its config file has no schema: the defaults list of "
                              f"configs/{group}/{option}.yaml must start with "
                              f"/schema/{group}/<option>@_here_, an option of "
                              f"{', '.join(schemas)}")
    _refuse_unknown_keys(cfg, "")
    try:
        app = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} is required (its config file leaves it ???): set "
                          f"{e.full_key}=...") from None
    assert isinstance(app, AppConfig)
    return app


def _refuse_unknown_keys(node: DictConfig, prefix: str) -> None:
    """``+group.key=value`` adds a key that no schema has, which ``OmegaConf.to_object`` would
    drop silently: refuse it, naming the option that has such a key, if one does."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form value (pipeline.options, data.train)
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(_unknown_key(full, schema))
        if not OmegaConf.is_missing(node, key) and OmegaConf.is_dict(node[key]):
            _refuse_unknown_keys(node[key], full + ".")


def _unknown_key(full_key: str, schema: type) -> str:
    group, _, key = full_key.partition(".")
    schemas = SCHEMAS.get(group)
    if not key or not isinstance(schemas, dict):
        return f"{full_key}: no such key in the config (a typo, or a key added with +)"
    having = [option for option, s in schemas.items()
              if key in {f.name for f in dataclasses.fields(s)}]
    if having:
        return (f"{full_key} needs {' or '.join(f'{group}={o}' for o in having)}: "
                f"{group}={getattr(schema, 'OPTION', '?')} has no such key")
    return f"{full_key}: no such key in {group}={getattr(schema, 'OPTION', '?')}"


__all__ = ["AppConfig", "ConfigError", "SCHEMAS", "options", "register", "typed"]
