"""The blob formats a manifest names, and what each allows a reader to do.

A version's blobs are MCKP containers (compressed), safetensors files (compression off) or
MLDC lossy deltas; small JSON/TOML files ride along. What differs between them for a reader
is declared here once, so code asks a format's properties instead of switching on names:

- ``lossless``: the lossless blob reader decodes it on its own (an MLDC blob decodes only
  along its chain, by the lossy tier);
- ``block_hashes``: every block carries hashes of its own, so a blob is verified in the same
  pass that decodes it (otherwise only its whole-file hash verifies it, before any use);
- ``in_place``: it can be decoded straight into live tensors, window by window;
- ``ranged_parts``: some of its tensors can be read alone, by ranges (a delta base's part).
"""

from __future__ import annotations

from dataclasses import dataclass

from mithril_async.errors import InvalidFormat

__all__ = ["FORMATS", "MCKP", "MLDC", "SAFETENSORS", "BlobFormat", "blob_format"]


@dataclass(frozen=True)
class BlobFormat:
    """One format a manifest's ``format`` field names (see the module docstring)."""

    name: str
    suffix: str
    lossless: bool
    block_hashes: bool
    in_place: bool
    ranged_parts: bool


MCKP = BlobFormat("mckp", ".mckp", lossless=True, block_hashes=True, in_place=True,
                  ranged_parts=True)
SAFETENSORS = BlobFormat("safetensors", ".safetensors", lossless=True, block_hashes=False,
                         in_place=True, ranged_parts=False)
MLDC = BlobFormat("mldc", ".mldc", lossless=False, block_hashes=False, in_place=False,
                  ranged_parts=False)
_JSON = BlobFormat("json", ".json", lossless=False, block_hashes=False, in_place=False,
                   ranged_parts=False)
_TOML = BlobFormat("toml", ".toml", lossless=False, block_hashes=False, in_place=False,
                   ranged_parts=False)

#: every format by the name a manifest gives it
FORMATS: dict[str, BlobFormat] = {f.name: f for f in (MCKP, SAFETENSORS, MLDC, _JSON, _TOML)}


def blob_format(name: str, where: str = "") -> BlobFormat:
    """The format a manifest names; :class:`InvalidFormat` for one this library does not
    know."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InvalidFormat(f"{where + ': ' if where else ''}unknown blob format {name!r}")
    return fmt
