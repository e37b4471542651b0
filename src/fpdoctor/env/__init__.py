"""The environment doctor: collect facts (live or from a file), judge them, report."""
