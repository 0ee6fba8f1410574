"""The frontend's telemetry, in one place.

    observe.py         every telemetry hook (metrics.py holds the metric objects)
    metrics.py         the gapserve:* metric objects
    vllm_metrics.py    vLLM's vllm:* series on /metrics beside gapserve:*
"""
