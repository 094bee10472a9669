"""Which errors mean "a peer is gone, re-form the job" and which are bugs that must end the rank."""
from __future__ import annotations

from comm.failures import PeerLost, is_peer_failure


def test_lost_peers_are_told_from_bugs():
    # gloo's TCP transport, as raised by torch 2.13 when a peer process is killed mid-collective
    assert is_peer_failure(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                                        "[127.0.0.1]:61060: Connection reset by peer"))
    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                        "[127.0.0.1]:8076"))
    assert is_peer_failure(PeerLost("rank 0 combine (layer 0): rank 3 died before sending round 7"))
    # bugs and refusals are not membership changes
    assert not is_peer_failure(RuntimeError("rank 1: 70 tokens exceed the step capacity 48"))
    assert not is_peer_failure(ValueError("Connection closed by peer"))     # not a runtime error of a transport
    assert not is_peer_failure(AssertionError("rank 0: 9 tokens > step capacity 8"))


def test_nccl_peer_losses_are_told_from_nccl_misuse():
    """NCCL's texts, as torch's ProcessGroupNCCL raises them (DistBackendError is a RuntimeError)."""
    from torch.distributed import DistBackendError

    assert is_peer_failure(DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, remote process exited or there was "
        "a network error, NCCL version 2.28.9\nncclRemoteError: A call failed possibly due to a network error or a "
        "remote process exiting prematurely."))
    assert is_peer_failure(DistBackendError("NCCL communicator was aborted on rank 1."))
    # two ranks on one GPU is a configuration bug, not a lost peer (the error seen on a real H100)
    assert not is_peer_failure(DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage (run with "
        "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid usage "
        "of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 60"))
