"""`python -m lorad.client.demo` (what `make demo` runs): a throwaway daemon learns a fictional user in minutes.

Public surface: `Demo`, `DemoSettings`, `DemoResult` (runner), `DemoDaemon` (daemon subprocess), and the persona
data helpers `load_samples`, `load_questions`, `mentions_fact`.
"""

from lorad.client.demo.daemon import DemoDaemon
from lorad.client.demo.persona import load_questions, load_samples, mentions_fact
from lorad.client.demo.runner import Demo, DemoResult, DemoSettings

__all__ = ["Demo", "DemoDaemon", "DemoResult", "DemoSettings", "load_questions", "load_samples", "mentions_fact"]
