"""The flags of quantized serving and of clients' choice of servers, parsed into their configs."""

import pytest

from bloompeer.weight_format import DEFAULT_GROUP_SIZE
from bloompeer.peer.cli.flags import client_config, server_config
from bloompeer.peer.cli.main import build_parser
from bloompeer.peer.server.config import ServerConfig


def _parse(*argv):
    return build_parser().parse_args(list(argv))


def test_serve_quant_flags_reach_the_server_config():
    config = server_config(_parse("serve", "--blocks", "0:2", "--quant", "int4", "--quant-group-size", "32"))
    assert (config.quant, config.quant_group_size) == ("int4", 32)
    default = server_config(_parse("serve", "--blocks", "0:2"))
    assert (default.quant, default.quant_group_size) == ("none", DEFAULT_GROUP_SIZE)
    assert ServerConfig(model="", start=None, end=None).quant_group_size == DEFAULT_GROUP_SIZE


def test_a_bare_num_blocks_asks_for_as_many_blocks_as_fit():
    assert server_config(_parse("serve", "--num-blocks")).num_blocks_to_serve == 0
    assert server_config(_parse("serve", "--num-blocks", "3")).num_blocks_to_serve == 3


@pytest.mark.parametrize("argv", [["--quant", "int3"], ["--quant-group-size", "48"]])
def test_bad_quant_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        _parse("serve", "--blocks", "0:2", *argv)
    assert "invalid choice" in capsys.readouterr().err


def test_generate_quant_allowed():
    assert client_config(_parse("generate", "hi")).quant_allowed == ("none", "int8", "int4")
    assert client_config(_parse("generate", "hi", "--quant-allowed", "none")).quant_allowed == ("none",)
    assert client_config(_parse("generate", "hi", "--quant-allowed", "int8,none")).quant_allowed == ("int8", "none")
    with pytest.raises(SystemExit):
        _parse("generate", "hi", "--quant-allowed", "none,fp8")
