"""Update precision: what an optimizer step did to low-precision weights (`measure`), what that
means (`judge`, `findings`, one finding per cause: `causes`), the fix tried as a short what-if
(`whatif`), and the same checks under `trace` (`under_trace`).
"""
