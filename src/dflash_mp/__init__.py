"""dflash_mp: a process-split distributed trainer for DFlash speculative-decoding drafters."""

__version__ = "0.1.0"
