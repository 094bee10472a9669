"""Telling a lost peer from a bug.

A rank that dies (or leaves a generation of the job to re-form it) breaks every exchange a survivor has with
it: gloo raises from its TCP pairs ("Connection closed by peer", "Connection reset by peer", a read or write
error on a pair), NCCL reports a remote error or an aborted communicator, and the shm and cuda_ipc
transports raise `PeerLost` when a sender's process is gone or a peer marked
its inbox aborted. Those errors mean "re-form the job"; any other exception is a bug and ends the rank.
"""
from __future__ import annotations


class PeerLost(RuntimeError):
    """A peer of this rank's data or control plane died or left the current generation."""


# Substrings of the errors gloo's TCP transport raises when a peer's connection goes away (third_party/gloo,
# transport/tcp/pair.cc), and torch's wrapper for a collective whose peer stopped answering.
_GLOO_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Write error",
                     "Broken pipe", "pair.cc", "Socket closed", "Connection refused")


# NCCL's (torch's ProcessGroupNCCL and NCCL's own ncclGetErrorString/ncclGetLastError texts): a peer that exits
# or whose connection drops surfaces as ncclRemoteError ("remote process exiting prematurely"), as a closed
# socket of NCCL's bootstrap/proxy, or as a communicator that torch's watchdog or this rank aborted.
_NCCL_PEER_ERRORS = ("ncclRemoteError", "remote process exit", "Connection closed by remote peer",
                     "NCCL communicator was aborted", "communicator was aborted", "Process group watchdog")


def is_peer_failure(exc: BaseException) -> bool:
    """True when exc says a peer went away (re-forming the job can recover), False for anything else."""
    if isinstance(exc, PeerLost):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(s in text for s in _GLOO_PEER_ERRORS + _NCCL_PEER_ERRORS)
