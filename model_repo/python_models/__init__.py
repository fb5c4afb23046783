"""The python-backend models trtforge copies into a repository as `<model>/1/model.py`.

They run inside Triton's python-backend stub and import what they share from this installed
package (base.py); the emitters copy them by these paths.
"""

from pathlib import Path

ENGINE_PY = Path(__file__).with_name("engine.py")
"""The engine model: `ensemble`, or a disaggregated repository's `context` and `generation`."""
ROUTER_PY = Path(__file__).with_name("router.py")
"""The router of a disaggregated repository (its `ensemble`)."""
