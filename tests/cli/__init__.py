"""Tests of the command line (kvpp_fx/cli/)."""
