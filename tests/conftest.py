import os
import sys

# Tests import the repo's packages without an install step.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
