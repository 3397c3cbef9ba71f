"""The commit pipeline: how a state becomes a sealed version in the log (``pipeline``), and how
every event is put into a log transaction (``append``)."""
