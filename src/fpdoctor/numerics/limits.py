"""The formats' limits, as the tracer and the headroom judge import them; the table itself is
`fpdoctor.formats`, below every capability, where the HTML report's plots read it too."""

from fpdoctor.formats import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE, UNDERFLOW_SHARE, Format, format_named

__all__ = ["DTYPE_FORMAT", "FORMATS", "OVERFLOW_SHARE", "UNDERFLOW_SHARE", "Format", "format_named"]
