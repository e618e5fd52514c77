"""``llmctl bench``: latency/throughput harness for OpenAI-compatible servers.

Imports flow one way: ``records`` <- ``datasets``/``arrivals``/``backends``/``metrics``
<- ``server_metrics``/``launcher`` <- ``runner`` <- ``report``/``plots``/``compare``.
The maths (``metrics``, ``arrivals``) are pure functions over plain data.
"""
