"""One base for every input fpdoctor refuses: a caller catches `fpdoctor.errors.InputError` (or
ValueError) whichever command read the input."""

from __future__ import annotations

import pytest

from fpdoctor.errors import InputError


def test_a_missing_env_file_and_a_missing_health_file_raise_the_same_error(tmp_path):
    from fpdoctor.env import parse
    from fpdoctor.health import inputs

    missing = str(tmp_path / "missing.log")
    with pytest.raises(InputError, match="does not exist"):
        inputs.read_text(missing)
    with pytest.raises(InputError):
        parse.load(missing)


def test_health_exports_the_shared_error():
    from fpdoctor.health import InputError as HealthInputError

    assert HealthInputError is InputError


def test_the_input_errors_of_records_devices_and_report_paths_are_input_errors(tmp_path):
    from fpdoctor.health.fingerprint import DeviceNotFound
    from fpdoctor.precision.record.record import RecordError
    from fpdoctor.report.write import write_text

    assert issubclass(RecordError, InputError) and issubclass(DeviceNotFound, InputError)
    with pytest.raises(InputError, match="is a directory"):
        write_text(str(tmp_path), "text")


def test_an_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)
