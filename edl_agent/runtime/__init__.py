"""What every long-running part of both processes stands on: the supervisor and its part
contract, the stop signal, one injectable clock, backoff, bounded id sets and durable writes.
Imports nothing else of edl_agent."""
