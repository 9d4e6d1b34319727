"""The Monitor tab and its parts: plots, the conversations table, counters."""

from desktop.monitor.tab import MonitorTab

__all__ = ["MonitorTab"]
