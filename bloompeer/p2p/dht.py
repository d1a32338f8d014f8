"""The swarm's directory: announcing and finding block servers on hivemind's Kademlia DHT.

Every call has a timeout: hivemind's lookups can wait forever on a value they cannot decode.
Records live under a subkey holding the owner's RSA public key. Two validators run on every
peer (they check records stored with them and records they read): hivemind's signature
validator refuses writes not signed by that key, and BlockRecordValidator refuses anything that
is not a well-formed ServerRecord of the peer that key names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import NamedTuple

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from .errors import ProtocolError
from .framing import unpack
from .identity import peer_id_of
from .records import ServerRecord, block_key

__all__ = ["BlockDirectory", "BlockRecordValidator", "FoundRecord", "make_record_validator", "get_dht_time"]

logger = logging.getLogger(__name__)


class BlockRecordValidator(RecordValidatorBase):
    """Accepts only server records, each under the subkey of the key that names its peer."""

    def validate(self, record: DHTRecord) -> bool:
        owners = RSASignatureValidator._PUBLIC_KEY_RE.findall(record.subkey or b"")
        if len(owners) != 1:
            return False
        try:
            server = ServerRecord.from_wire(unpack(record.value))
            return server.peer_id == peer_id_of(RSAPublicKey.from_bytes(owners[0]))
        except (ProtocolError, ValueError):
            return False

    @property
    def priority(self) -> int:
        return 0  # runs on the value after the signature validator has checked and stripped it


def make_record_validator(signing_key: RSAPrivateKey | None) -> tuple[CompositeValidator, bytes]:
    """The validator every peer installs, and the subkey under which this peer's records go."""
    signature = RSASignatureValidator(signing_key)
    return CompositeValidator([signature, BlockRecordValidator()]), signature.local_public_key


class FoundRecord(NamedTuple):
    record: ServerRecord
    expiration_time: float  # DHT time (get_dht_time) at which the DHT forgets it


class BlockDirectory:
    """Block records of one or more models on a DHT node that this process runs."""

    def __init__(self, node: DHTNode, subkey: bytes, timeout_s: float = 10.0):
        self.node, self.subkey, self.timeout_s = node, subkey, timeout_s

    async def announce(
        self, model_uid: str, blocks: Iterable[int], record: ServerRecord, expiration_time: float
    ) -> bool:
        """Store `record` for each block under this peer's signed subkey. True if all stores succeeded."""
        keys = [block_key(model_uid, index) for index in blocks]
        value = record.to_wire()
        try:
            results = await asyncio.wait_for(
                self.node.store_many(
                    keys, [value] * len(keys), expiration_time, subkeys=[self.subkey] * len(keys)
                ),
                self.timeout_s,
            )
        except asyncio.TimeoutError:
            logger.warning("Announcing %d block(s) of %s timed out after %.0f s", len(keys), model_uid, self.timeout_s)
            return False
        return all(results.values())

    async def find_servers(self, model_uid: str, num_model_blocks: int) -> dict[int, list[ServerRecord]]:
        """Latest records of every server of every block; malformed records are skipped."""
        found = await self.find_records(model_uid, num_model_blocks)
        return {index: [item.record for item in items] for index, items in found.items()}

    async def find_records(self, model_uid: str, num_model_blocks: int) -> dict[int, list[FoundRecord]]:
        """find_servers' records, each with the DHT time it expires at."""
        keys = [block_key(model_uid, index) for index in range(num_model_blocks)]
        try:
            found = await asyncio.wait_for(
                self.node.get_many(keys, sufficient_expiration_time=float("inf")), self.timeout_s
            )
        except asyncio.TimeoutError:
            logger.warning("Looking up %s's servers timed out after %.0f s", model_uid, self.timeout_s)
            return {}
        servers: dict[int, list[FoundRecord]] = {}
        for index, key in enumerate(keys):
            entry = found.get(key)
            if entry is None or not isinstance(entry.value, dict):
                continue
            servers[index] = [FoundRecord(record, item.expiration_time) for item in entry.value.values()
                              if (record := _parse(item.value, key)) is not None]
        return servers


def _parse(value: object, key: str) -> ServerRecord | None:
    try:
        return ServerRecord.from_wire(value)
    except ProtocolError as exc:
        logger.debug("Skipping a malformed record under %s: %s", key, exc)
        return None
