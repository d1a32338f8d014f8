"""A peer's identity: one RSA key that both names the peer on libp2p and signs its DHT records.

libp2p derives an RSA peer id ("Qm...") from the public key, so anyone can check that a record
signed by a key really comes from the peer it names: a peer cannot announce blocks in another
peer's name.
"""

from __future__ import annotations

import hashlib

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from .errors import RequestError

__all__ = ["IdentityError", "load_rsa_identity", "peer_id_of"]


class IdentityError(RequestError):
    """The identity file is not an RSA libp2p private key."""


def load_rsa_identity(path: str) -> RSAPrivateKey:
    """The RSA key in a libp2p identity file (as hivemind's P2P writes them)."""
    try:
        with open(path, "rb") as f:
            protobuf = crypto_pb2.PrivateKey.FromString(f.read())
    except (OSError, ValueError) as exc:
        raise IdentityError(f"cannot read the identity file {path}: {exc}") from exc
    if protobuf.key_type != crypto_pb2.KeyType.RSA:
        raise IdentityError(f"{path} holds a {crypto_pb2.KeyType.Name(protobuf.key_type)} key; bloompeer servers "
                            f"need an RSA identity (remove the file to have one created)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind has no constructor from bytes; this is its unpickling
    key.__setstate__({"_private_key": protobuf.data})
    return key


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: a sha2-256 multihash of its protobuf."""
    der = public_key._public_key.public_bytes(  # hivemind exposes only the OpenSSH encoding
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()
