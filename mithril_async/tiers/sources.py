"""Where the copy of a file that a recovery uses lies: a typed value, not text.

A recovery takes each file it needs from the fastest place holding it intact: this node's own
folder, the copies this node keeps for other nodes (its replica folder), a peer rank's folder
(sent over the tier group), or the remote bucket. :class:`Source` names one of those places;
``str()`` gives the text that logs and reports show (``"local"``, ``"local replica"``,
``"rank 2 (replica)"``, ``"remote"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Place(Enum):
    """A kind of folder a copy lies in."""

    #: a node's own folder (the files its ranks wrote)
    NODE = "local"
    #: a node's replica folder (copies it keeps for the ranks of other nodes)
    REPLICA = "replica"
    #: the remote bucket (``[checkpointing.remote]``)
    REMOTE = "remote"


@dataclass(frozen=True)
class Source:
    """A place a copy came from: ``place`` on this node, or at peer ``rank``."""

    place: Place
    #: the peer rank that sent the copy from its ``place``; None: this node (or the remote)
    rank: int | None = None

    @classmethod
    def peer(cls, rank: int, place: Place) -> Source:
        return cls(place, rank)

    @property
    def on_node(self) -> bool:
        """The copy lies in one of this node's own folders (nothing was fetched)."""
        return self.rank is None and self.place is not Place.REMOTE

    def __str__(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank} ({self.place.value})"
        return "local replica" if self.place is Place.REPLICA else self.place.value


#: this node's own folder
OWN_FOLDER = Source(Place.NODE)
#: this node's replica folder
OWN_REPLICA = Source(Place.REPLICA)
#: the remote bucket
REMOTE = Source(Place.REMOTE)
