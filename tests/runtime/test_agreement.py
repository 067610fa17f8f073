"""The per-forward agreement alone: one rank's key against a peer's, folded in by the all-reduce's MAX."""

from datetime import timedelta

import pytest
import torch

from kvpp_fx.runtime.agreement import Agreement, AgreementKey, ForwardPath
from kvpp_fx.runtime.collectives import Collectives
from kvpp_fx.runtime.device import DeviceAPI
from kvpp_fx.runtime.errors import BlockSetMismatchError, TransferFailedError
from kvpp_fx.runtime.health import Health


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class PeerAPI(DeviceAPI):
    """A one-rank MAX all-reduce that also folds in a peer's key, as two ranks' all-reduce would."""

    def __init__(self, peer: AgreementKey | None, fail: bool = False) -> None:
        super().__init__("cpu")
        self.peer, self.fail = peer, fail
        self.tensors = []

    def all_reduce_max(self, tensor, group):
        if self.fail:
            raise RuntimeError("connection closed")
        self.tensors.append(tensor)
        values = self.peer.values()
        torch.maximum(tensor, torch.tensor([*values, *(-v for v in values)]), out=tensor)
        return _Done()


def agreement(api: DeviceAPI) -> tuple[Agreement, Health]:
    health = Health(0)
    return Agreement(api, Collectives(api, timedelta(seconds=1), health), None, True, torch.device("cpu")), health


KEY = AgreementKey(ForwardPath.ACTIVE_BLOCKS, block_count=3, block_digest=(1 << 61) + 12345, query_tokens=-1)


def test_equal_keys_agree_and_the_tensor_is_reused():
    api = PeerAPI(KEY)
    agree, _ = agreement(api)
    agree.agree(KEY)
    api.peer = AgreementKey(ForwardPath.NO_HISTORY)  # the next forward: another key, equal on both ranks
    agree.agree(api.peer)
    assert len(api.tensors) == 2 and api.tensors[0] is api.tensors[1]


@pytest.mark.parametrize("peer,named", [
    (AgreementKey(ForwardPath.WHOLE_LAYERS, query_tokens=-1),
     ["history and path", "active-block count", "active-block set"]),
    (AgreementKey(ForwardPath.ACTIVE_BLOCKS, 3, (1 << 61) + 12346, -1), ["active-block set"]),
    (AgreementKey(ForwardPath.ACTIVE_BLOCKS, 4, (1 << 61) + 12345, -1), ["active-block count"]),
    (AgreementKey(ForwardPath.ACTIVE_BLOCKS, 3, (1 << 61) + 12345, 7), ["query tokens"]),
    (AgreementKey(ForwardPath.OWNER, 3, (1 << 61) + 12345, -1), ["history and path"]),
    (AgreementKey(ForwardPath.ACTIVE_BLOCKS, 3, (1 << 61) + 12345, -1, history_ahead=1), ["history ahead"]),
])
def test_a_peer_that_differs_is_named_field_by_field(peer, named):
    agree, health = agreement(PeerAPI(peer))
    with pytest.raises(BlockSetMismatchError) as error:
        agree.agree(KEY)
    message = str(error.value)
    fields = ("history and path", "active-block count", "active-block set", "query tokens", "history ahead")
    assert [f for f in fields if f in message.split("; every rank")[0]] == named
    assert "this rank: path 2, 3 blocks" in message and "Nothing was moved" in message
    assert health.cause is None  # the agreement kept the group in step: the runtime stays usable


def test_an_all_reduce_that_cannot_be_issued_breaks_the_runtime():
    agree, health = agreement(PeerAPI(KEY, fail=True))
    with pytest.raises(TransferFailedError, match="the forward's agreement could not be issued: connection closed"):
        agree.agree(KEY)
    assert isinstance(health.cause, TransferFailedError)
