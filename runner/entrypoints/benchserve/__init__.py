"""``python -m runner bench-serve``: serving throughput and latency as ``vllm bench serve`` measures them.

An HTTP client of the OpenAI server (``/v1/completions``, streamed): it sends a random-token workload at a
request rate (Poisson arrivals, or all at once) or under a concurrency cap, and reports request and token
throughput, time to first token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end
latency at their mean, median, p90 and p99, and how many engine steps ran as two DBO ubatches (read from the
server's ``/metrics`` before and after). ``--compare dbo`` runs the same workload against a server with DBO off
and one with DBO on, alternating, and prints both with their ratio.
"""
