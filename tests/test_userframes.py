"""The user's frames are told apart without torch imported: torch's, fpdoctor's and the standard
library's files are not the user's, the casebook's models and packages installed beside the
standard library are."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fpdoctor
from fpdoctor.userframes import CASEBOOK_DIR, OWN_DIR, is_user_file


def test_importing_it_and_reading_a_frame_import_no_torch():
    code = textwrap.dedent("""
        import sys
        from fpdoctor.userframes import user_location
        location = user_location(sys._getframe())
        assert location is not None and location[0] == "<string>", location
        assert "torch" not in sys.modules, sorted(sys.modules)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr


def test_whose_file_it_is():
    import torch.nn.functional

    assert os.path.dirname(fpdoctor.__file__) + os.sep == OWN_DIR
    assert not is_user_file(torch.nn.functional.__file__)
    assert not is_user_file(os.path.join(OWN_DIR, "numerics", "tracer_like.py"))
    assert is_user_file(os.path.join(CASEBOOK_DIR, "model.py"))
    assert not is_user_file(os.__file__)
    assert is_user_file(os.path.join(os.path.dirname(os.__file__), "site-packages", "theirs", "model.py"))
    assert is_user_file(__file__)
