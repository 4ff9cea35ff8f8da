package kvsvc

// The error contract of kvsvc, mirrored from kvsvc/errors/: one type per
// way a caller reacts. Every error this package returns for a failed call is
// one of the class types below (each embeds *KVServiceError), and errors.As
// follows the Python hierarchy: an *UnsupportedRequest is also an
// *InvalidRequest, a *MappingLost also a *NotFound, and every class is a
// *KVServiceError. errors_test.go checks these types against kvsvc.errors'
// reason catalogue (proto/kvsvc/v1/reasons.json).

import (
	"fmt"
	"strings"

	pb "github.com/kvsvc/kvsvc/clients/go/gen/kvsvc/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// EnvelopeVersion is the RemoteError envelope version this client reads.
const EnvelopeVersion = 1

// KVServiceError is the base of every kvsvc error; every field is readable,
// whatever the server sent.
type KVServiceError struct {
	// Class is the name of the class type this error was built as, e.g. "MappingLost".
	Class string
	// Message is the human-readable message (at most 4096 bytes from a server).
	Message string
	// Code is the gRPC code as received (it may be one this client does not know).
	Code codes.Code
	// Reason is the stable machine-readable identifier, e.g. "MAPPING_NOT_FOUND".
	Reason string
	// Metadata holds every dynamic value the message mentions.
	Metadata map[string]string
	// RequestID finds the server-side traceback in the server log; for a
	// transfer it is the transfer id that Fence takes.
	RequestID string
	// Retryable tells whether repeating the same request here may succeed.
	Retryable bool
	// TransferState says what a failed transfer did to the caller's buffers;
	// TRANSFER_STATE_UNKNOWN means fence before reusing them.
	TransferState pb.TransferState
	// Type is the class name of the exception raised on the server, or Class
	// for errors made by this client.
	Type string
	// MessageTruncated is true when the server cut the message to its bound.
	MessageTruncated bool
	// Remote is true for an in-band RemoteError, false for a transport failure.
	Remote bool
	// Method is the RPC that failed, e.g. "Store" or "Health.Check".
	Method string
	// EnvelopeVersion is the version of the envelope (0 when not from one).
	EnvelopeVersion uint32
	// Cause is the underlying transport error, if any.
	Cause error
}

func (e *KVServiceError) Error() string {
	rid := ""
	if e.RequestID != "" {
		rid = " request_id=" + e.RequestID
	}
	return fmt.Sprintf("%s: %s [%s%s]", e.Class, e.Message, e.Reason, rid)
}

// Unwrap returns the transport error this error was made from, if any.
func (e *KVServiceError) Unwrap() error { return e.Cause }

// GRPCStatus lets status.FromError and status.Code read the error's code.
func (e *KVServiceError) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// BuffersReusable is true when no copy of the failed call can still be running.
func (e *KVServiceError) BuffersReusable() bool {
	return e.TransferState != pb.TransferState_TRANSFER_STATE_UNKNOWN
}

// IsClass reports whether e is of the named class or one of its subclasses,
// e.g. IsClass("NotFound") for a MappingLost.
func (e *KVServiceError) IsClass(name string) bool {
	if name == "KVServiceError" {
		return true
	}
	for c := e.Class; c != ""; c = classes[c].parent {
		if c == name {
			return true
		}
	}
	return false
}

// The classes of kvsvc.errors, each declaring only its code and reason.
type (
	// InvalidRequest: the caller fixes its input or falls back (recompute).
	InvalidRequest struct{ *KVServiceError }
	// UnsupportedRequest: a request this server does not understand (unset oneof, newer envelope).
	UnsupportedRequest struct{ *KVServiceError }
	// MalformedRequest: request bytes the server could not parse as the method's message.
	MalformedRequest struct{ *KVServiceError }
	// LayoutMismatch: chunks only load into the layout they were stored with.
	LayoutMismatch struct{ *KVServiceError }
	// NotFound: something named by the request does not exist.
	NotFound struct{ *KVServiceError }
	// Miss: a chunk the caller required is not in the store.
	Miss struct{ *KVServiceError }
	// MappingLost: the mapping is unknown (server restarted or unmapped); map again.
	MappingLost struct{ *KVServiceError }
	// CudaUnavailable: a CUDA IPC handle reached a server without CUDA; no retry can help.
	CudaUnavailable struct{ *KVServiceError }
	// CapacityExhausted: the chunk store cannot hold the data.
	CapacityExhausted struct{ *KVServiceError }
	// PermissionDenied: the caller's tenant may not do this; nothing is said about what exists.
	PermissionDenied struct{ *KVServiceError }
	// Unauthenticated: no valid credentials (a missing, unknown or expired token).
	Unauthenticated struct{ *KVServiceError }
	// Unimplemented: the server does not implement the call.
	Unimplemented struct{ *KVServiceError }
	// DeadlineExceeded: the call's deadline passed.
	DeadlineExceeded struct{ *KVServiceError }
	// Cancelled: the call was cancelled (its context was cancelled).
	Cancelled struct{ *KVServiceError }
	// ServiceUnavailable: the transport failed (connection refused or lost); retry may succeed.
	ServiceUnavailable struct{ *KVServiceError }
	// ServiceNotServing: the instance had a fatal failure or is shutting down; go elsewhere.
	ServiceNotServing struct{ *KVServiceError }
	// TransferUnprovable: a copy may still be writing the caller's blocks; fence first.
	TransferUnprovable struct{ *KVServiceError }
	// RegionUnavailable: a mapped region cannot be used (missing, too small, truncated).
	RegionUnavailable struct{ *KVServiceError }
	// RemoteHandlerError: a server handler failed unexpectedly; see the server log.
	RemoteHandlerError struct{ *KVServiceError }
	// DataLoss: a stored chunk failed its checksum on the server.
	DataLoss struct{ *KVServiceError }
	// FatalServerError: device error or dead transfer worker; the instance stops serving.
	FatalServerError struct{ *KVServiceError }
)

type class struct {
	parent    string
	code      codes.Code
	reason    string
	retryable bool
	wrap      func(*KVServiceError) error
}

// classOrder is kvsvc.errors' declaration order: the first class declared for a code is its default.
var classOrder = []string{
	"InvalidRequest", "UnsupportedRequest", "MalformedRequest", "LayoutMismatch", "NotFound", "Miss",
	"MappingLost", "CudaUnavailable", "CapacityExhausted", "PermissionDenied", "Unauthenticated",
	"Unimplemented", "DeadlineExceeded",
	"Cancelled", "ServiceUnavailable",
	"ServiceNotServing", "TransferUnprovable", "RegionUnavailable", "RemoteHandlerError",
	"DataLoss", "FatalServerError",
}

var classes = map[string]class{
	"InvalidRequest":     {"", codes.InvalidArgument, "INVALID_ARGUMENT", false, func(e *KVServiceError) error { return &InvalidRequest{e} }},
	"UnsupportedRequest": {"InvalidRequest", codes.InvalidArgument, "UNSUPPORTED_REQUEST", false, func(e *KVServiceError) error { return &UnsupportedRequest{e} }},
	"MalformedRequest":   {"InvalidRequest", codes.InvalidArgument, "MALFORMED_REQUEST", false, func(e *KVServiceError) error { return &MalformedRequest{e} }},
	"LayoutMismatch":     {"", codes.FailedPrecondition, "LAYOUT_MISMATCH", false, func(e *KVServiceError) error { return &LayoutMismatch{e} }},
	"NotFound":           {"", codes.NotFound, "NOT_FOUND", false, func(e *KVServiceError) error { return &NotFound{e} }},
	"Miss":               {"NotFound", codes.NotFound, "CHUNK_NOT_FOUND", false, func(e *KVServiceError) error { return &Miss{e} }},
	"MappingLost":        {"NotFound", codes.NotFound, "MAPPING_NOT_FOUND", false, func(e *KVServiceError) error { return &MappingLost{e} }},
	"CudaUnavailable":    {"", codes.FailedPrecondition, "CUDA_UNAVAILABLE", false, func(e *KVServiceError) error { return &CudaUnavailable{e} }},
	"CapacityExhausted":  {"", codes.ResourceExhausted, "CAPACITY_EXHAUSTED", false, func(e *KVServiceError) error { return &CapacityExhausted{e} }},
	"PermissionDenied":   {"", codes.PermissionDenied, "PERMISSION_DENIED", false, func(e *KVServiceError) error { return &PermissionDenied{e} }},
	"Unauthenticated":    {"", codes.Unauthenticated, "UNAUTHENTICATED", false, func(e *KVServiceError) error { return &Unauthenticated{e} }},
	"Unimplemented":      {"", codes.Unimplemented, "UNIMPLEMENTED", false, func(e *KVServiceError) error { return &Unimplemented{e} }},
	"DeadlineExceeded":   {"", codes.DeadlineExceeded, "DEADLINE_EXCEEDED", false, func(e *KVServiceError) error { return &DeadlineExceeded{e} }},
	"Cancelled":          {"", codes.Canceled, "CANCELLED", false, func(e *KVServiceError) error { return &Cancelled{e} }},
	"ServiceUnavailable": {"", codes.Unavailable, "TRANSPORT_UNAVAILABLE", true, func(e *KVServiceError) error { return &ServiceUnavailable{e} }},
	"ServiceNotServing":  {"", codes.Unavailable, "SERVICE_NOT_SERVING", false, func(e *KVServiceError) error { return &ServiceNotServing{e} }},
	"TransferUnprovable": {"", codes.Unknown, "TRANSFER_UNPROVABLE", false, func(e *KVServiceError) error { return &TransferUnprovable{e} }},
	"RegionUnavailable":  {"", codes.FailedPrecondition, "REGION_UNAVAILABLE", false, func(e *KVServiceError) error { return &RegionUnavailable{e} }},
	"RemoteHandlerError": {"", codes.Internal, "HANDLER_FAILED", false, func(e *KVServiceError) error { return &RemoteHandlerError{e} }},
	"DataLoss":           {"RemoteHandlerError", codes.DataLoss, "CHECKSUM_MISMATCH", false, func(e *KVServiceError) error { return &DataLoss{e} }},
	"FatalServerError":   {"RemoteHandlerError", codes.Internal, "FATAL_SERVER_ERROR", false, func(e *KVServiceError) error { return &FatalServerError{e} }},
}

var (
	byReason = map[string]string{}
	byCode   = map[codes.Code]string{}
)

func init() {
	for _, name := range classOrder {
		c := classes[name]
		byReason[c.reason] = name
		if _, ok := byCode[c.code]; !ok {
			byCode[c.code] = name
		}
	}
	byCode[codes.Unavailable] = "ServiceUnavailable"
	byCode[codes.Internal] = "RemoteHandlerError"
	byCode[codes.Unknown] = "RemoteHandlerError"
}

// Classes lists the class names this client knows, in kvsvc.errors' order.
func Classes() []string { return append([]string(nil), classOrder...) }

// As lets errors.As find any ancestor class (and *KVServiceError) of e.
func (e *KVServiceError) As(target interface{}) bool {
	var ok bool
	switch t := target.(type) {
	case **KVServiceError:
		*t, ok = e, true
	case **InvalidRequest:
		if ok = e.IsClass("InvalidRequest"); ok {
			*t = &InvalidRequest{e}
		}
	case **UnsupportedRequest:
		if ok = e.IsClass("UnsupportedRequest"); ok {
			*t = &UnsupportedRequest{e}
		}
	case **MalformedRequest:
		if ok = e.IsClass("MalformedRequest"); ok {
			*t = &MalformedRequest{e}
		}
	case **LayoutMismatch:
		if ok = e.IsClass("LayoutMismatch"); ok {
			*t = &LayoutMismatch{e}
		}
	case **NotFound:
		if ok = e.IsClass("NotFound"); ok {
			*t = &NotFound{e}
		}
	case **Miss:
		if ok = e.IsClass("Miss"); ok {
			*t = &Miss{e}
		}
	case **MappingLost:
		if ok = e.IsClass("MappingLost"); ok {
			*t = &MappingLost{e}
		}
	case **CudaUnavailable:
		if ok = e.IsClass("CudaUnavailable"); ok {
			*t = &CudaUnavailable{e}
		}
	case **CapacityExhausted:
		if ok = e.IsClass("CapacityExhausted"); ok {
			*t = &CapacityExhausted{e}
		}
	case **PermissionDenied:
		if ok = e.IsClass("PermissionDenied"); ok {
			*t = &PermissionDenied{e}
		}
	case **Unauthenticated:
		if ok = e.IsClass("Unauthenticated"); ok {
			*t = &Unauthenticated{e}
		}
	case **Unimplemented:
		if ok = e.IsClass("Unimplemented"); ok {
			*t = &Unimplemented{e}
		}
	case **DeadlineExceeded:
		if ok = e.IsClass("DeadlineExceeded"); ok {
			*t = &DeadlineExceeded{e}
		}
	case **Cancelled:
		if ok = e.IsClass("Cancelled"); ok {
			*t = &Cancelled{e}
		}
	case **ServiceUnavailable:
		if ok = e.IsClass("ServiceUnavailable"); ok {
			*t = &ServiceUnavailable{e}
		}
	case **ServiceNotServing:
		if ok = e.IsClass("ServiceNotServing"); ok {
			*t = &ServiceNotServing{e}
		}
	case **TransferUnprovable:
		if ok = e.IsClass("TransferUnprovable"); ok {
			*t = &TransferUnprovable{e}
		}
	case **RegionUnavailable:
		if ok = e.IsClass("RegionUnavailable"); ok {
			*t = &RegionUnavailable{e}
		}
	case **RemoteHandlerError:
		if ok = e.IsClass("RemoteHandlerError"); ok {
			*t = &RemoteHandlerError{e}
		}
	case **DataLoss:
		if ok = e.IsClass("DataLoss"); ok {
			*t = &DataLoss{e}
		}
	case **FatalServerError:
		if ok = e.IsClass("FatalServerError"); ok {
			*t = &FatalServerError{e}
		}
	}
	return ok
}

// build fills the class defaults into e and returns it as its class type
// (a bare *KVServiceError for the empty class name).
func build(name string, e *KVServiceError) error {
	c, known := classes[name]
	if !known {
		e.Class = "KVServiceError"
		if e.Type == "" {
			e.Type = e.Class
		}
		return e
	}
	e.Class = name
	if e.Type == "" {
		e.Type = name
	}
	return c.wrap(e)
}

// FromRemoteError is the error for a RemoteError envelope (kvsvc.errors'
// from_remote_error): transfer state UNKNOWN gives TransferUnprovable, else the
// class named by the envelope's type, else by its reason, else by its code.
func FromRemoteError(env *pb.RemoteError, method string) error {
	code := codes.Code(env.GetCode())
	name := ""
	switch {
	case env.GetTransferState() == pb.TransferState_TRANSFER_STATE_UNKNOWN:
		name = "TransferUnprovable"
	case classes[env.GetType()].wrap != nil:
		name = env.GetType()
	case byReason[env.GetReason()] != "":
		name = byReason[env.GetReason()]
	default:
		name = byCode[classCode(code)]
	}
	md := make(map[string]string, len(env.GetMetadata()))
	for k, v := range env.GetMetadata() {
		md[k] = v
	}
	return build(name, &KVServiceError{
		Message:          env.GetMessage(),
		Code:             code,
		Reason:           env.GetReason(),
		Metadata:         md,
		RequestID:        env.GetRequestId(),
		Retryable:        env.GetRetryable(),
		TransferState:    env.GetTransferState(),
		Type:             env.GetType(),
		MessageTruncated: env.GetMessageTruncated(),
		Remote:           true,
		Method:           method,
		EnvelopeVersion:  env.GetEnvelopeVersion(),
	})
}

// classCode is the code used to pick a class: one this client does not know is
// UNKNOWN, as in kvsvc.errors; CODE_UNSPECIFIED (0) picks none.
func classCode(c codes.Code) codes.Code {
	if c > codes.Unauthenticated {
		return codes.Unknown
	}
	return c
}

// FromGRPCError maps a transport failure (kvsvc.errors' from_grpc_error). With
// transferStarted, a block transfer whose reply was lost after it may have
// reached the server becomes TransferUnprovable; with transfer and not
// started, the error says NOT_STARTED.
func FromGRPCError(err error, requestID, method string, transfer, transferStarted bool) error {
	st, _ := status.FromError(err)
	code := st.Code()
	details := st.Message()
	if details == "" {
		details = codeName(code)
	}
	md := map[string]string{"grpcCode": codeName(code)}
	base := &KVServiceError{
		Code:      code,
		Metadata:  md,
		RequestID: requestID,
		Method:    method,
		Cause:     err,
	}
	// UNIMPLEMENTED and UNAUTHENTICATED are answered before any handler runs.
	if transfer && transferStarted && code != codes.Unimplemented && code != codes.Unauthenticated {
		base.Message = fmt.Sprintf("transfer outcome unknown after %s: %s", codeName(code), details)
		base.Reason = classes["TransferUnprovable"].reason
		base.TransferState = pb.TransferState_TRANSFER_STATE_UNKNOWN
		return build("TransferUnprovable", base)
	}
	name := byCode[classCode(code)]
	if name == "RemoteHandlerError" {
		name = "" // nothing ran on the server: the plain base class
	}
	base.Message = details
	base.Reason = "TRANSPORT_" + codeName(code)
	base.Retryable = code == codes.Unavailable
	if transfer {
		base.TransferState = pb.TransferState_TRANSFER_STATE_NOT_STARTED
	}
	return build(name, base)
}

// codeName is the canonical UPPER_SNAKE name of a gRPC code ("DEADLINE_EXCEEDED").
func codeName(c codes.Code) string {
	if n, ok := pb.Code_name[int32(c)]; ok && c != 0 {
		return strings.TrimPrefix(n, "CODE_")
	}
	if c == codes.OK {
		return "OK"
	}
	return fmt.Sprintf("CODE_%d", uint32(c))
}
