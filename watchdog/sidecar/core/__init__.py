"""The pure core: fold observations, forecast, decide. No I/O, no clock but the observations'."""
