"""Report, Finding and Severity, their redaction and renderers."""

from fpdoctor.report.model import SCHEMA, Finding, Report, Severity

__all__ = ["SCHEMA", "Finding", "Report", "Severity"]
