"""Cloud preemption notices: which cloud this is (``detect_cloud``, ``resolve_clouds``), what its metadata
service announces (``Notice``), and a poller that asks it off the training thread (``NoticePoller``).

The parts: ``detect`` (local DMI evidence, no socket), ``protocols`` (the documented requests and pure
parsers of their answers), ``poller`` (the HTTP on a daemon thread). Wiring a poller into training (saving
on a notice, stopping on a preempt) is the owner's: ``lightning_resume.exact``.
"""

from lightning_resume.cloud.detect import detect_cloud, resolve_clouds
from lightning_resume.cloud.poller import NoticePoller
from lightning_resume.cloud.protocols import Notice

__all__ = ["Notice", "NoticePoller", "detect_cloud", "resolve_clouds"]
