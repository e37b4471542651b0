"""Compare records: one machine's compare run saved, another machine's run judged against it."""
