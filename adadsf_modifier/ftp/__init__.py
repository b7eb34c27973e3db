"""FTP (fine-grained token-wise pruning, arXiv 2412.11494) as a second modifier on the
routing machinery of AdaDSF: the routed layers, causal thresholds, KV caches and FLOPs
recorder are AdaDSF's; this package adds the four-feature shared router, the static
router, the genetic sparsity scheduler, the losses and the training loop
(``docs/ftp.md``)."""

from adadsf_modifier.ftp.checkpoint import FTP_SIDECAR, load_ftp
from adadsf_modifier.ftp.features import LayerFeatureStats, calibrate_features
from adadsf_modifier.ftp.modifier import FTPModifier
from adadsf_modifier.ftp.router import FTPLayerRouter, FTPRouterMLP, ftp_routers
from adadsf_modifier.ftp.scheduler import ScheduleResult, genetic_schedule
from adadsf_modifier.ftp.static import static_keep_mask
from adadsf_modifier.ftp.trainer import FTPTrainConfig, train_router

__all__ = [
    "FTP_SIDECAR",
    "load_ftp",
    "FTPModifier",
    "FTPLayerRouter",
    "FTPRouterMLP",
    "FTPTrainConfig",
    "LayerFeatureStats",
    "ScheduleResult",
    "calibrate_features",
    "ftp_routers",
    "genetic_schedule",
    "static_keep_mask",
    "train_router",
]
