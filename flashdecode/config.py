"""Typed configurations: every launch decision of an op, made once.

A config is a frozen dataclass resolved by a pure function of a problem description and device facts
(flashdecode/heuristics.py); ops take ``config=`` to override it (``dataclasses.replace`` of the resolved one).
"""

from __future__ import annotations
