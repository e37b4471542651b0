"""The dtype audit: mixed dtypes and devices, dtype errors explained, fixes checked; harmonize and
the fp32 boundary casts it and plan apply."""
