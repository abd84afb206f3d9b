import os
import sys

# The launchers these tests start (torchrun, torchx's local_cwd, which runs `torchrun` by
# name) need the venv's bin on PATH. Put it there for this process too: torch builds the C++
# kernel with the first `ninja` on PATH, and two ninja versions (venv 1.13, system 1.11) hash
# the build command differently, so mixing them rebuilds the kernel (about a minute) each time.
_BIN = os.path.dirname(sys.executable)
if not os.environ.get("PATH", "").startswith(_BIN + os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")
