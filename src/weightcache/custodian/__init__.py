"""The custodian: one small long-lived process per socket directory (per node and user) that holds a duplicate
of every rank's block descriptors with its manifest and key, so a cache outlives its daemon.

``messages`` (its typed protocol), ``checks`` (what a deposit must be before it is held), ``store`` (what is
held and for whom, the leases), ``server`` (the holder process) and ``client`` (talking to it, starting it).
It imports no torch and never maps, decodes or imports the memory it holds.
"""

from ..sockets import custodian_socket_path
from .client import CustodianClient, connect_or_launch, launch
from .messages import CustodianError, CustodianUnresponsive, Holding
from .server import Custodian, main

__all__ = ["Custodian", "CustodianClient", "CustodianError", "CustodianUnresponsive", "Holding",
           "connect_or_launch", "launch", "main", "custodian_socket_path"]
