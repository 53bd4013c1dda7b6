//! Errors: one enum whose variants say what kind of thing went wrong, so a
//! caller can match on it, each carrying a message a user can act on.

use std::fmt;

/// What went wrong. The message (`Display`) names the file, flag, op or
/// device involved and, where there is one, what to do about it.
#[non_exhaustive]
pub enum Error {
    /// Operand shapes that do not fit an operation.
    Shape(String),
    /// Operands of different element types, or one an operation or a device
    /// does not take (f64 off the CPU, an f64 parameter for an optimizer).
    DType(String),
    /// An index outside what it indexes: a token id outside the vocabulary,
    /// a row id past a table, a class target past the logits.
    Index(String),
    /// Devices: operands on different devices, a device this build or
    /// machine does not have (no `gpu` feature, no adapter), and the GPU's
    /// failures — a device limit exceeded, a kernel that failed to compile,
    /// a lost device, a failed readback.
    Device(String),
    /// A file or stream operation failed; `source` is the operating system's error.
    Io {
        /// What was being done, to which path (e.g. `cannot read x.txt`).
        context: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A checkpoint that is missing, corrupt, tampered with or does not match the run.
    Checkpoint(String),
    /// Invalid configuration: flags, hyper-parameters, a model config.
    Config(String),
    /// Training text that cannot be used (unreadable, empty, binary, too short).
    Data(String),
    /// Non-finite losses or gradients, a collapsed loss scale.
    Numerical(String),
    /// The GPU's results differ from the CPU reference's (found by a
    /// cross-check); the message is the report.
    Divergence(String),
    /// A broken invariant of tinyllm itself (a bug to report, not bad input).
    Internal(String),
}

impl Error {
    /// An [`Error::Shape`] (operands that do not fit an operation) with message `msg`.
    pub fn shape(msg: impl Into<String>) -> Self {
        Error::Shape(msg.into())
    }
    /// An [`Error::DType`] (element types that do not fit) with message `msg`.
    pub fn dtype(msg: impl Into<String>) -> Self {
        Error::DType(msg.into())
    }
    /// An [`Error::Index`] (an id or index out of range) with message `msg`.
    pub fn index(msg: impl Into<String>) -> Self {
        Error::Index(msg.into())
    }
    /// An [`Error::Device`] (a device mismatch, a missing device, a GPU
    /// failure) carrying the message `msg`.
    pub fn device(msg: impl Into<String>) -> Self {
        Error::Device(msg.into())
    }
    /// An [`Error::Checkpoint`] (an unusable checkpoint) carrying the message `msg`.
    pub fn checkpoint(msg: impl Into<String>) -> Self {
        Error::Checkpoint(msg.into())
    }
    /// An [`Error::Config`] (invalid configuration) carrying the message `msg`.
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }
    /// An [`Error::Data`] (unusable training text) carrying the message `msg`.
    pub fn data(msg: impl Into<String>) -> Self {
        Error::Data(msg.into())
    }
    /// An [`Error::Numerical`] (non-finite values, a collapsed loss scale) with message `msg`.
    pub fn numerical(msg: impl Into<String>) -> Self {
        Error::Numerical(msg.into())
    }
    /// An [`Error::Internal`] (a broken invariant: a bug) carrying the message `msg`.
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }
    /// An I/O failure, `context` saying what was being done to which path.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Prefixes the message with where it happened (a file, a flag, an op);
    /// the kind is kept.
    pub fn context(self, ctx: impl fmt::Display) -> Self {
        self.map_message(|m| format!("{ctx}: {m}"))
    }

    /// The same kind with its message rewritten by `f` (for an I/O error, the
    /// context part).
    pub fn map_message(self, f: impl FnOnce(&str) -> String) -> Self {
        let pre = |m: String| f(&m);
        match self {
            Error::Shape(m) => Error::Shape(pre(m)),
            Error::DType(m) => Error::DType(pre(m)),
            Error::Index(m) => Error::Index(pre(m)),
            Error::Device(m) => Error::Device(pre(m)),
            Error::Io { context, source } => Error::Io {
                context: pre(context),
                source,
            },
            Error::Checkpoint(m) => Error::Checkpoint(pre(m)),
            Error::Config(m) => Error::Config(pre(m)),
            Error::Data(m) => Error::Data(pre(m)),
            Error::Numerical(m) => Error::Numerical(pre(m)),
            Error::Divergence(m) => Error::Divergence(pre(m)),
            Error::Internal(m) => Error::Internal(pre(m)),
        }
    }

    /// The whole message, as `Display` writes it.
    pub fn message(&self) -> String {
        self.to_string()
    }

    /// The variant's name: `Config`, `Io`, ….
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Shape(_) => "Shape",
            Error::DType(_) => "DType",
            Error::Index(_) => "Index",
            Error::Device(_) => "Device",
            Error::Io { .. } => "Io",
            Error::Checkpoint(_) => "Checkpoint",
            Error::Config(_) => "Config",
            Error::Data(_) => "Data",
            Error::Numerical(_) => "Numerical",
            Error::Divergence(_) => "Divergence",
            Error::Internal(_) => "Internal",
        }
    }
}

/// `{:?}` is the message, as `Display` writes it, so a
/// `fn main() -> tinyllm::Result<()>` that fails prints `Error: <message>`;
/// `{:#?}` adds the kind (`Config: <message>`).
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            write!(f, "{}: ", self.kind())?;
        }
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Shape(m)
            | Error::DType(m)
            | Error::Index(m)
            | Error::Device(m)
            | Error::Checkpoint(m)
            | Error::Config(m)
            | Error::Data(m)
            | Error::Numerical(m)
            | Error::Divergence(m)
            | Error::Internal(m) => f.write_str(m),
            Error::Io { context, source } => write!(f, "{context}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The crate's result type: `std::result::Result` with [`Error`] as its error.
pub type Result<T> = std::result::Result<T, Error>;

/// `bail!(Kind, "...", args)`: return an [`Error::Kind`](Error) built with `format!`.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($arg:tt)*) => {
        return Err($crate::Error::$kind(format!($($arg)*)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_reads_as_the_message() {
        let e = Error::config("--lr must be positive, got -1");
        assert_eq!(format!("{e:?}"), "--lr must be positive, got -1");
        assert_eq!(format!("{e:#?}"), "Config: --lr must be positive, got -1");
        // what `main` returning this error prints after `Error: `
        let main = || -> Result<()> { Err(Error::data("x.txt: empty")) };
        assert_eq!(format!("{:?}", main().unwrap_err()), "x.txt: empty");
    }

    #[test]
    fn context_keeps_the_kind_and_io_keeps_its_source() {
        let e = Error::config("bad").context("--lr");
        assert!(matches!(&e, Error::Config(m) if m == "--lr: bad"));
        let io = Error::io(
            "cannot read x.txt",
            std::io::Error::from(std::io::ErrorKind::NotFound),
        )
        .context("corpus");
        assert!(io.to_string().starts_with("corpus: cannot read x.txt: "));
        let src = std::error::Error::source(&io).expect("an I/O error has a source");
        assert_eq!(
            src.downcast_ref::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::NotFound)
        );
    }
}
