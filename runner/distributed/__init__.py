"""Process plumbing: device choice, launch and rendezvous, liveness, and the per-step DP agreement."""
