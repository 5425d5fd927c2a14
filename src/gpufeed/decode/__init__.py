"""Decode: encoded bytes to pixels. One file per backend."""

from .base import DEFAULT_MAX_PIXELS, DecodeError, is_jpeg
from .cpu import CpuDecoder

__all__ = ["DEFAULT_MAX_PIXELS", "CpuDecoder", "DecodeError", "is_jpeg"]
