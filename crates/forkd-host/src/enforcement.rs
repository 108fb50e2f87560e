//! How strictly a host-side protection of VMs (their cgroups, their jail) is applied,
//! as an environment variable says: `auto` (the default: where the host allows it),
//! `required` (a VM that cannot have it does not start) or `off`.

/// How strictly a protection is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    /// Applied where the host allows; VMs run without it (and it is said) elsewhere.
    Auto,
    /// A VM that cannot have it does not start.
    Required,
    /// Never applied.
    Off,
}

impl Enforcement {
    /// The value of the variable `var`, `auto` when unset; an unknown value is an error
    /// that names the variable.
    pub fn from_env(var: &str) -> Result<Enforcement, String> {
        match std::env::var(var).as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(Enforcement::Auto),
            Ok("required") => Ok(Enforcement::Required),
            Ok("off") => Ok(Enforcement::Off),
            Ok(other) => Err(format!("{var}={other:?}: expected auto, required or off")),
        }
    }
}
