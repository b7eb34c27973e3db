"""FTP (fine-grained token-wise pruning, arXiv 2412.11494) on AdaDSF's routing
machinery (``docs/ftp.md``)."""

from adadsf_modifier.ftp.checkpoint import FTP_SIDECAR, load_ftp
from adadsf_modifier.ftp.features import LayerFeatureStats, calibrate_features
from adadsf_modifier.ftp.modifier import FTPModifier
from adadsf_modifier.ftp.router import FTPLayerRouter, FTPRouterMLP, ftp_layers
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
    "ftp_layers",
    "genetic_schedule",
    "static_keep_mask",
    "train_router",
]
