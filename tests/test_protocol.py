import pytest

from metrale_model_engine import PROTOCOL_ENV_VAR, EpProtocol


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, EpProtocol.V1),
        ("", EpProtocol.V1),
        ("   ", EpProtocol.V1),
        ("v1", EpProtocol.V1),
        ("V1", EpProtocol.V1),
        ("v2", EpProtocol.V2),
        ("V2", EpProtocol.V2),
        ("  v2\n", EpProtocol.V2),
        ("\tV2 ", EpProtocol.V2),
    ],
)
def test_from_env_table(raw: str | None, expected: EpProtocol) -> None:
    environ = {} if raw is None else {PROTOCOL_ENV_VAR: raw}
    assert EpProtocol.from_env(environ) is expected


@pytest.mark.parametrize("raw", ["v3", "2", "v 2", "version2", "v1,v2"])
def test_from_env_rejects_other_values(raw: str) -> None:
    with pytest.raises(ValueError) as info:
        EpProtocol.from_env({PROTOCOL_ENV_VAR: raw})
    message = str(info.value)
    assert PROTOCOL_ENV_VAR in message and repr(raw) in message and "'v1', 'v2'" in message


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTOCOL_ENV_VAR, "v2")
    assert EpProtocol.from_env() is EpProtocol.V2
    monkeypatch.delenv(PROTOCOL_ENV_VAR)
    assert EpProtocol.from_env() is EpProtocol.V1


def test_each_version_has_a_fixed_setup_code() -> None:
    assert (EpProtocol.V1.code, EpProtocol.V2.code) == (1, 2)
