"""The job config: one dataclass per concern (each lives next to the code it configures),
gathered here and registered with Hydra's ConfigStore. YAML under `conf/` only overlays it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .checkpoint import CheckpointConfig
from .data import DataConfig
from .liveness import LivenessConfig
from .metrics import LoggingConfig
from .target import TargetConfig
from .topology import TopologyConfig
from .trainer import DrafterConfig, TrainConfig
from .transport import TransportConfig


@dataclass
class JobConfig:
    name: str = "default"  # run name; the run directory defaults to outputs/<name>
    run_dir: str = "outputs/${name}"  # pinned (not per-rank timestamps): every rank agrees on it
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)


def register() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job(cfg) -> JobConfig:
    """DictConfig -> JobConfig dataclass (core code never sees a DictConfig)."""
    return OmegaConf.to_object(cfg)


def compose(overrides: list[str] | None = None) -> JobConfig:
    """Compose the job config outside @hydra.main (tests, tools)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = hcompose(config_name="config", overrides=overrides or [])
    return to_job(cfg)


def _conf_dir() -> str:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "..", "..", "conf"), os.path.join(here, "conf")):
        if os.path.isfile(os.path.join(cand, "config.yaml")):
            return os.path.abspath(cand)
    raise FileNotFoundError("dflash_mp: conf/ not found; install from a checkout with `pip install -e .`.")


CONF_DIR = _conf_dir()
