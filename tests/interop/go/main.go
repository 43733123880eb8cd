// Command jobsignal-go-peer is a grpc-go client of job.Job for jobsignal's interop tests.
//
// It is built at test time in GOPATH mode against Debian's grpc-go, with the
// message and service stubs generated from protos/job/job.proto by protoc
// (see tests/interop/peers.py). Everything it observes goes to stdout as one
// JSON object per line, so the tests can assert on it:
//
//	{"event":"state","state":"READY","t":0.01}          connectivity changes
//	{"event":"registered","code":200,"info":"...","clientId":"..."}
//	{"event":"message","size":123,"signals":[...],...}   one per stream message
//	{"event":"dialed","local":"127.0.0.1:40000"}        each TCP connection (plain text only)
//	{"event":"ping"}                                     each PING the client sent (plain text only)
//	{"event":"goaway","code":11,"debug":"too_many_pings"} seen on the wire (plain text only)
//	{"event":"end","rpc":"...","code":14,"codeName":"Unavailable","message":"..."}
//	{"event":"wire","sent":{"PING":3},"received":{...},"compressedData":2}
//	                                                     HTTP/2 frame counts, and the DATA frames
//	                                                     sent that begin with a compressed
//	                                                     message's flag (plain text only)
//
//	{"event":"register-failed","try":1,"message":"..."}  fdagent: a Register that did not succeed
//	{"event":"fatal","rpc":"..."}                        fdagent: a stream ended (it gives up)
//	{"event":"survived"}                                 fdagent: -run-for passed, both streams open
//
// Usage: jobsignal-go-peer COMMAND [flags], COMMAND one of register,
// subscribe, subscribe-list, fdagent. With no flags the client uses grpc-go's
// defaults (dynamic BDP flow-control windows, no keepalive, 4 MiB receive limit).
//
// fdagent behaves, as far as a server can see, like ClusterD's fault-diagnosis
// agent: default dial options (no keepalive), Register retried -register-tries
// times -register-every apart, then the List and the Signal streams (a Register
// each), and any end of either stream is fatal (exit status 3), as that agent's
// v7.x releases never recover from one.
package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding/gzip"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "jobsignalinterop/job"
)

var started = time.Now()

// -- output -------------------------------------------------------------------

var outputLock sync.Mutex

func emit(event string, fields map[string]interface{}) {
	fields["event"] = event
	fields["t"] = time.Since(started).Seconds()
	line, err := json.Marshal(fields)
	if err != nil {
		panic(err)
	}
	outputLock.Lock()
	defer outputLock.Unlock()
	os.Stdout.Write(append(line, '\n'))
}

func emitEnd(rpc string, err error) {
	st := status.Convert(err)
	emit("end", map[string]interface{}{
		"rpc": rpc, "code": int(st.Code()), "codeName": st.Code().String(), "message": st.Message(),
	})
}

func signalJSON(s *pb.JobSummarySignal) map[string]interface{} {
	digest := sha256.Sum256([]byte(s.HcclJson))
	return map[string]interface{}{
		"uuid": s.Uuid, "jobId": s.JobId, "jobName": s.JobName, "namespace": s.Namespace,
		"frameWork": s.FrameWork, "jobStatus": s.JobStatus, "time": s.Time, "cmIndex": s.CmIndex,
		"total": s.Total, "deleteTime": s.DeleteTime, "sharedTorIp": s.SharedTorIp,
		"masterAddr": s.MasterAddr, "operator": s.Operator, "sid": s.Sid,
		"hcclBytes": len(s.HcclJson), "hcclSha256": hex.EncodeToString(digest[:]),
	}
}

// -- HTTP/2 frame counting ------------------------------------------------------

var frameNames = map[byte]string{
	0: "DATA", 1: "HEADERS", 2: "PRIORITY", 3: "RST_STREAM", 4: "SETTINGS", 5: "PUSH_PROMISE",
	6: "PING", 7: "GOAWAY", 8: "WINDOW_UPDATE", 9: "CONTINUATION",
}

// frameCounter follows one direction of an HTTP/2 connection and counts frames by type.
type frameCounter struct {
	skip    int // bytes still to drop before the next frame header (client preface)
	header  []byte
	left    uint32 // payload bytes of the current frame still to come
	kind    byte
	payload []byte // kept for GOAWAY frames only
	counts  map[string]*int64
	onFrame func(kind byte, flags byte, payload []byte)
}

func newFrameCounter(skip int, onFrame func(byte, byte, []byte)) *frameCounter {
	counts := map[string]*int64{}
	for _, name := range frameNames {
		counts[name] = new(int64)
	}
	return &frameCounter{skip: skip, counts: counts, onFrame: onFrame}
}

func (c *frameCounter) feed(data []byte) {
	for len(data) > 0 {
		switch {
		case c.skip > 0:
			n := min(c.skip, len(data))
			c.skip -= n
			data = data[n:]
		case c.left > 0:
			n := min(int(c.left), len(data))
			if c.kind == 7 {
				c.payload = append(c.payload, data[:n]...)
			} else if c.kind == 0 && len(c.payload) == 0 {
				c.payload = append(c.payload, data[0]) // a DATA frame's first byte
			}
			c.left -= uint32(n)
			data = data[n:]
			if c.left == 0 {
				c.finish()
			}
		default:
			n := min(9-len(c.header), len(data))
			c.header = append(c.header, data[:n]...)
			data = data[n:]
			if len(c.header) == 9 {
				c.left = uint32(c.header[0])<<16 | uint32(c.header[1])<<8 | uint32(c.header[2])
				c.kind = c.header[3]
				c.payload = c.payload[:0]
				if c.left == 0 {
					c.finish()
				}
			}
		}
	}
}

func (c *frameCounter) finish() {
	if name, ok := frameNames[c.kind]; ok {
		atomic.AddInt64(c.counts[name], 1)
	}
	if c.onFrame != nil {
		c.onFrame(c.kind, c.header[4], c.payload)
	}
	c.header = c.header[:0]
}

func (c *frameCounter) snapshot() map[string]int64 {
	out := map[string]int64{}
	for name, count := range c.counts {
		if n := atomic.LoadInt64(count); n > 0 {
			out[name] = n
		}
	}
	return out
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}

// countingConn counts the HTTP/2 frames crossing a plain-text connection.
type countingConn struct {
	net.Conn
	sent, received *frameCounter
	readLock       sync.Mutex
	writeLock      sync.Mutex
}

func (c *countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.readLock.Lock()
	c.received.feed(b[:n])
	c.readLock.Unlock()
	return n, err
}

func (c *countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.writeLock.Lock()
	c.sent.feed(b[:n])
	c.writeLock.Unlock()
	return n, err
}

var (
	connsLock sync.Mutex
	conns     []*countingConn
	// DATA frames sent whose first byte is a gRPC message's compressed flag set
	// (this client's requests are small: one frame each, unpadded).
	compressedData int64
)

func countingDialer(ctx context.Context, address string) (net.Conn, error) {
	raw, err := (&net.Dialer{}).DialContext(ctx, "tcp", address)
	if err != nil {
		return nil, err
	}
	onReceived := func(kind byte, flags byte, payload []byte) {
		if kind == 7 && len(payload) >= 8 {
			emit("goaway", map[string]interface{}{
				"code":  binary.BigEndian.Uint32(payload[4:8]),
				"debug": string(payload[8:]),
			})
		}
	}
	onSent := func(kind byte, flags byte, payload []byte) {
		if kind == 6 && flags&1 == 0 { // a PING of ours, not an ACK
			emit("ping", map[string]interface{}{})
		}
		if kind == 0 && len(payload) > 0 && payload[0] == 1 {
			atomic.AddInt64(&compressedData, 1)
		}
	}
	conn := &countingConn{
		Conn:     raw,
		sent:     newFrameCounter(24, onSent), // after "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
		received: newFrameCounter(0, onReceived),
	}
	emit("dialed", map[string]interface{}{"local": raw.LocalAddr().String()})
	connsLock.Lock()
	conns = append(conns, conn)
	connsLock.Unlock()
	return conn, nil
}

func emitWire() {
	connsLock.Lock()
	defer connsLock.Unlock()
	sent, received := map[string]int64{}, map[string]int64{}
	for _, conn := range conns {
		for name, n := range conn.sent.snapshot() {
			sent[name] += n
		}
		for name, n := range conn.received.snapshot() {
			received[name] += n
		}
	}
	emit("wire", map[string]interface{}{
		"connections": len(conns), "sent": sent, "received": received,
		"compressedData": atomic.LoadInt64(&compressedData),
	})
}

// -- options ---------------------------------------------------------------------

type options struct {
	target, role, subscribeRole, clientID      string
	keepalive, keepaliveTimeout, timeout, hold time.Duration
	permitWithoutStream                        bool
	window, connWindow, maxRecv, count         int
	tlsCA, tlsCert, tlsKey, serverName         string
	compress                                   bool
	registerTries                              int
	registerEvery, runFor                      time.Duration
	resubscribes                               int
}

func parse(command string, args []string) options {
	var o options
	flags := flag.NewFlagSet(command, flag.ExitOnError)
	flags.StringVar(&o.target, "target", "127.0.0.1:8899", "server HOST:PORT")
	flags.StringVar(&o.role, "role", "CCAgent", "role to register with")
	flags.StringVar(&o.subscribeRole, "subscribe-role", "", "role to subscribe with (default: -role)")
	flags.StringVar(&o.clientID, "client-id", "", "subscribe with this clientId instead of registering")
	flags.DurationVar(&o.keepalive, "keepalive", 0, "keepalive.ClientParameters.Time (0: no keepalive)")
	flags.DurationVar(&o.keepaliveTimeout, "keepalive-timeout", 20*time.Second, "keepalive ping ACK timeout")
	flags.BoolVar(&o.permitWithoutStream, "permit-without-stream", false, "keepalive pings with no active RPC")
	flags.IntVar(&o.window, "window", 0, "fixed stream flow-control window (0: grpc-go default, BDP)")
	flags.IntVar(&o.connWindow, "conn-window", 0, "fixed connection window (0: grpc-go default, BDP)")
	flags.IntVar(&o.maxRecv, "max-recv", 0, "largest message accepted (0: grpc-go default, 4 MiB)")
	flags.IntVar(&o.count, "count", 0, "stop after this many stream messages (0: until the stream ends)")
	flags.DurationVar(&o.timeout, "timeout", 60*time.Second, "deadline of the whole run")
	flags.DurationVar(&o.hold, "hold", 0, "register: keep the connection open this long afterwards")
	flags.StringVar(&o.tlsCA, "tls-ca", "", "PEM CA bundle: use TLS and trust these CAs")
	flags.StringVar(&o.tlsCert, "tls-cert", "", "PEM client certificate (mutual TLS)")
	flags.StringVar(&o.tlsKey, "tls-key", "", "PEM key of -tls-cert")
	flags.StringVar(&o.serverName, "server-name", "", "TLS server name override")
	flags.BoolVar(&o.compress, "gzip", false, "compress every request message with gzip")
	flags.IntVar(&o.registerTries, "register-tries", 20, "fdagent: Register attempts before giving up")
	flags.DurationVar(&o.registerEvery, "register-every", 3*time.Second, "fdagent: time between Register attempts")
	flags.DurationVar(&o.runFor, "run-for", 30*time.Second, "fdagent: how long both streams must stay open")
	flags.IntVar(&o.resubscribes, "resubscribes", 1, "resubscribe: Register and Subscribe again this many times after a stream end")
	flags.Parse(args)
	if o.subscribeRole == "" {
		o.subscribeRole = o.role
	}
	return o
}

func dialOptions(o options) ([]grpc.DialOption, error) {
	var dial []grpc.DialOption
	if o.tlsCA != "" {
		config := &tls.Config{ServerName: o.serverName, RootCAs: x509.NewCertPool()}
		pem, err := os.ReadFile(o.tlsCA)
		if err != nil {
			return nil, err
		}
		if !config.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("no certificate in %s", o.tlsCA)
		}
		if o.tlsCert != "" {
			pair, err := tls.LoadX509KeyPair(o.tlsCert, o.tlsKey)
			if err != nil {
				return nil, err
			}
			config.Certificates = []tls.Certificate{pair}
		}
		dial = append(dial, grpc.WithTransportCredentials(credentials.NewTLS(config)))
	} else {
		dial = append(dial, grpc.WithInsecure(), grpc.WithContextDialer(countingDialer))
	}
	if o.keepalive > 0 {
		dial = append(dial, grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time: o.keepalive, Timeout: o.keepaliveTimeout, PermitWithoutStream: o.permitWithoutStream,
		}))
	}
	// Setting either window turns grpc-go's BDP estimator off.
	if o.window > 0 {
		dial = append(dial, grpc.WithInitialWindowSize(int32(o.window)))
	}
	if o.connWindow > 0 {
		dial = append(dial, grpc.WithInitialConnWindowSize(int32(o.connWindow)))
	}
	if o.maxRecv > 0 {
		dial = append(dial, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(o.maxRecv)))
	}
	if o.compress {
		dial = append(dial, grpc.WithDefaultCallOptions(grpc.UseCompressor(gzip.Name)))
	}
	return dial, nil
}

func watchState(ctx context.Context, conn *grpc.ClientConn) {
	state := conn.GetState()
	emit("state", map[string]interface{}{"state": state.String()})
	for conn.WaitForStateChange(ctx, state) {
		state = conn.GetState()
		emit("state", map[string]interface{}{"state": state.String()})
	}
}

// -- commands ---------------------------------------------------------------------

func register(ctx context.Context, client pb.JobClient, role string) (string, bool) {
	reply, err := client.Register(ctx, &pb.ClientInfo{Role: role})
	if err != nil {
		emitEnd("Register", err)
		return "", false
	}
	emit("registered", map[string]interface{}{
		"code": reply.Code, "info": reply.Info, "clientId": reply.ClientId,
	})
	return reply.ClientId, reply.Code == 200
}

type receiver interface {
	RecvMsg(m interface{}) error
}

// receive reads the stream until it ends or -count messages have come in all
// (counting `before`, those of earlier streams); it returns how many came in all.
func receive(o options, rpc string, stream receiver, list bool, before ...int) int {
	received := 0
	if len(before) > 0 {
		received = before[0]
	}
	for o.count == 0 || received < o.count {
		var message proto.Message
		if list {
			message = &pb.JobSummarySignalList{}
		} else {
			message = &pb.JobSummarySignal{}
		}
		if err := stream.RecvMsg(message); err != nil {
			emitEnd(rpc, err) // io.EOF converts to OK
			return received
		}
		received++
		fields := map[string]interface{}{"size": proto.Size(message)}
		if list {
			batch := message.(*pb.JobSummarySignalList)
			signals := []interface{}{}
			for _, s := range batch.JobSummarySignals {
				signals = append(signals, signalJSON(s))
			}
			fields["signals"] = signals
			fields["ReportTime"] = batch.ReportTime
			fields["JobTotalNum"] = batch.JobTotalNum
		} else {
			fields["signals"] = []interface{}{signalJSON(message.(*pb.JobSummarySignal))}
		}
		emit("message", fields)
	}
	emit("done", map[string]interface{}{"received": received})
	return received
}

// registerRetrying registers as -role, retrying failures -register-every apart.
func registerRetrying(ctx context.Context, client pb.JobClient, o options) (string, bool) {
	for try := 1; try <= o.registerTries; try++ {
		reply, err := client.Register(ctx, &pb.ClientInfo{Role: o.role})
		if err == nil && reply.Code == 200 {
			emit("registered", map[string]interface{}{
				"code": reply.Code, "info": reply.Info, "clientId": reply.ClientId,
			})
			return reply.ClientId, true
		}
		message := ""
		if err != nil {
			message = status.Convert(err).Message()
		} else {
			message = fmt.Sprintf("%d %s", reply.Code, reply.Info)
		}
		emit("register-failed", map[string]interface{}{"try": try, "message": message})
		select {
		case <-time.After(o.registerEvery):
		case <-ctx.Done():
			return "", false
		}
	}
	return "", false
}

func fdAgent(ctx context.Context, client pb.JobClient, o options) int {
	ended := make(chan string, 2)
	for _, list := range []bool{true, false} {
		list := list // (before Go 1.22, one variable for every iteration)
		id, ok := registerRetrying(ctx, client, o)
		if !ok {
			emit("fatal", map[string]interface{}{"rpc": "Register"})
			return 3
		}
		info := &pb.ClientInfo{Role: o.role, ClientId: id}
		var stream receiver
		var err error
		rpc := "SubscribeJobSummarySignal"
		if list {
			rpc = "SubscribeJobSummarySignalList"
			stream, err = client.SubscribeJobSummarySignalList(ctx, info)
		} else {
			stream, err = client.SubscribeJobSummarySignal(ctx, info)
		}
		if err != nil {
			emitEnd(rpc, err)
			emit("fatal", map[string]interface{}{"rpc": rpc})
			return 3
		}
		go func() {
			receive(o, rpc, stream, list)
			ended <- rpc
		}()
	}
	select {
	case rpc := <-ended:
		emit("fatal", map[string]interface{}{"rpc": rpc})
		return 3
	case <-time.After(o.runFor):
		emit("survived", map[string]interface{}{})
		return 0
	}
}

func run(command string, o options) int {
	dial, err := dialOptions(o)
	if err != nil {
		emit("error", map[string]interface{}{"message": err.Error()})
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	conn, err := grpc.DialContext(ctx, o.target, dial...)
	if err != nil {
		emit("error", map[string]interface{}{"message": err.Error()})
		return 2
	}
	defer conn.Close()
	go watchState(ctx, conn)
	client := pb.NewJobClient(conn)
	defer emitWire()
	if command == "fdagent" {
		return fdAgent(ctx, client, o)
	}

	clientID := o.clientID
	if clientID == "" || command == "register" {
		id, ok := register(ctx, client, o.role)
		if !ok {
			return 0
		}
		clientID = id
	}
	info := &pb.ClientInfo{Role: o.subscribeRole, ClientId: clientID}
	switch command {
	case "register":
		if o.hold > 0 {
			select {
			case <-time.After(o.hold):
			case <-ctx.Done():
			}
			emit("held", map[string]interface{}{"state": conn.GetState().String()})
		}
	case "subscribe":
		stream, err := client.SubscribeJobSummarySignal(ctx, info)
		if err != nil {
			emitEnd("SubscribeJobSummarySignal", err)
			return 0
		}
		receive(o, "SubscribeJobSummarySignal", stream, false)
	case "resubscribe":
		// Subscribe; on a stream end, Register and Subscribe again on the same
		// ClientConn (a new connection once the old one had GOAWAY), until -count
		// messages have come over all the streams.
		received := 0
		for again := 0; ; again++ {
			stream, err := client.SubscribeJobSummarySignal(ctx, info)
			if err != nil {
				emitEnd("SubscribeJobSummarySignal", err)
				return 0
			}
			received = receive(o, "SubscribeJobSummarySignal", stream, false, received)
			if received >= o.count || again >= o.resubscribes {
				return 0
			}
			id, ok := register(ctx, client, o.role)
			if !ok {
				return 0
			}
			info = &pb.ClientInfo{Role: o.subscribeRole, ClientId: id}
		}
	case "subscribe-list":
		stream, err := client.SubscribeJobSummarySignalList(ctx, info)
		if err != nil {
			emitEnd("SubscribeJobSummarySignalList", err)
			return 0
		}
		receive(o, "SubscribeJobSummarySignalList", stream, true)
	}
	return 0
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: jobsignal-go-peer register|subscribe|resubscribe|subscribe-list|fdagent [flags]")
		os.Exit(2)
	}
	command := os.Args[1]
	switch command {
	case "register", "subscribe", "resubscribe", "subscribe-list", "fdagent":
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n", command)
		os.Exit(2)
	}
	os.Exit(run(command, parse(command, os.Args[2:])))
}
