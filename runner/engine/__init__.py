"""The engine client: tokenization, output processing (detokenization, stop strings, n samples) and routing
requests to the DP ranks' engine cores; what the front ends talk to."""
