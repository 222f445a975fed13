"""Long scenarios shared by ``bench/`` (full runs that write ``bench/results``) and
``tests/integration`` (short runs that assert): each module's ``scenario`` returns a result dict."""
