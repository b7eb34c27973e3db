"""FTP (fine-grained token-wise pruning, arXiv 2412.11494) on AdaDSF's routing
machinery (``docs/ftp.md``)."""

from adadsf_modifier.ftp.checkpoint import load_ftp
from adadsf_modifier.ftp.modifier import FTPModifier
from adadsf_modifier.ftp.router import FTPLayerRouter
from adadsf_modifier.ftp.scheduler import genetic_schedule
from adadsf_modifier.ftp.trainer import FTPTrainConfig, train_router

__all__ = [
    "FTPLayerRouter",
    "FTPModifier",
    "FTPTrainConfig",
    "genetic_schedule",
    "load_ftp",
    "train_router",
]
