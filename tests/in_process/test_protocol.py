import pytest

from metrale_model_engine import PROTOCOL_ENV_VAR, ProtocolVersion


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, ProtocolVersion.V1),
        ("", ProtocolVersion.V1),
        ("   ", ProtocolVersion.V1),
        ("v1", ProtocolVersion.V1),
        ("V1", ProtocolVersion.V1),
        ("v2", ProtocolVersion.V2),
        ("V2", ProtocolVersion.V2),
        ("  v2\n", ProtocolVersion.V2),
        ("\tV2 ", ProtocolVersion.V2),
    ],
)
def test_from_env_table(raw: str | None, expected: ProtocolVersion) -> None:
    environ = {} if raw is None else {PROTOCOL_ENV_VAR: raw}
    assert ProtocolVersion.from_env(environ) is expected


@pytest.mark.parametrize("raw", ["v3", "2", "v 2", "version2", "v1,v2"])
def test_from_env_rejects_other_values(raw: str) -> None:
    with pytest.raises(ValueError) as info:
        ProtocolVersion.from_env({PROTOCOL_ENV_VAR: raw})
    message = str(info.value)
    assert PROTOCOL_ENV_VAR in message and repr(raw) in message and "'v1', 'v2'" in message


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTOCOL_ENV_VAR, "v2")
    assert ProtocolVersion.from_env() is ProtocolVersion.V2
    monkeypatch.delenv(PROTOCOL_ENV_VAR)
    assert ProtocolVersion.from_env() is ProtocolVersion.V1


def test_each_version_has_a_fixed_setup_code() -> None:
    assert (ProtocolVersion.V1.code, ProtocolVersion.V2.code) == (1, 2)
