// Command reference is the benchmark's grpc-go reference server: job.Job's
// Register and SubscribeJobSummarySignal written the way ClusterD writes them.
//
//	reference (-jobs-file FILE | -kube-url URL [-namespace NS]) [-buffer 10]
//	          [-snapshot-roles FdAgent] [-deadline SECONDS]
//
// Every stream is served by its own goroutine (grpc-go's handler goroutine)
// reading the subscriber's buffered channel of -buffer messages; publishing
// puts the same message into every subscriber's channel and drops it for a
// subscriber whose channel is full (nobody is disconnected); each stream's
// Send marshals the message for itself, as ClusterD's does. A subscriber of a
// -snapshot-roles role (ClusterD v7.3: FdAgent) is first sent the latest
// state of every job, taken under the same lock that adds its channel (so no
// change falls between the two), and the stream counts as up (the stats'
// `subscribers`) only once that snapshot is sent.
//
// The events come from one of two sources. With -kube-url, the Kubernetes
// API (the benchmark's emulator): LIST then WATCH of the job-summary
// ConfigMaps of -namespace (package kubewatch), one event per change of a
// job, its `sid` passed through (the cluster stamps the write time there).
// With -jobs-file, the benchmark's in-process driver: the jobs in the file (a
// JSON list of JobSummarySignal field maps written by the orchestrator from
// the same bench/events.py jobs the Python servers cycle), each publish a
// fresh message with a new uuid and the publish time in `sid` (Unix
// nanoseconds). It speaks the control protocol of bench/reference_server.py:
// the ready line with the port, then JSON commands on stdin (stats; mode
// idle, rate with `rate` events/s, flood with threshold, batch and quantile;
// the driver's modes only with -jobs-file).
package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"jobsignalbench/childproc"
	pb "jobsignalbench/job"
	"jobsignalbench/kubewatch"
)

// ClusterD's role whitelist (bench/common.py ROLES).
var roles = map[string]bool{"CCAgent": true, "DefaultUser1": true, "DefaultUser2": true, "FdAgent": true}

const (
	maxClients      = 100_000          // bench/common.py MAX_CLIENTS
	maxMessageBytes = 64 * 1024 * 1024 // bench/common.py MAX_MESSAGE_BYTES
	levelSample     = 200              // bench/common.py LEVEL_SAMPLE
	pushesPerBatch  = 16_000           // bench/common.py PUSHES_PER_PUBLISH
)

type subscription struct {
	messages chan *pb.JobSummarySignal
}

type server struct {
	pb.UnimplementedJobServer
	buffer        int
	snapshotRoles map[string]bool

	lock          sync.Mutex
	registered    map[string]string
	subscriptions map[*subscription]struct{}
	jobs          map[string]*pb.JobSummarySignal // the latest state of every job (Kubernetes source)

	up        int64 // atomic: streams subscribed, their snapshot (if any) sent
	published int64 // atomic
	dropped   int64 // atomic: messages not queued because a channel was full
	snapshots int64 // atomic: snapshot messages sent
}

func newUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

func (s *server) Register(ctx context.Context, info *pb.ClientInfo) (*pb.Status, error) {
	if !roles[info.Role] {
		return nil, status.Errorf(codes.InvalidArgument, "role %q is not allowed", info.Role)
	}
	s.lock.Lock()
	defer s.lock.Unlock()
	if len(s.registered) >= maxClients {
		return &pb.Status{Code: 429, Info: "too many registered clients"}, nil
	}
	id := newUUID()
	s.registered[id] = info.Role
	return &pb.Status{Code: 200, Info: "registration successful", ClientId: id}, nil
}

func (s *server) SubscribeJobSummarySignal(info *pb.ClientInfo, stream pb.Job_SubscribeJobSummarySignalServer) error {
	s.lock.Lock()
	role, ok := s.registered[info.ClientId]
	if !ok {
		s.lock.Unlock()
		return status.Error(codes.FailedPrecondition, "register first")
	}
	if role != info.Role {
		s.lock.Unlock()
		return status.Error(codes.PermissionDenied, "role mismatch")
	}
	sub := &subscription{messages: make(chan *pb.JobSummarySignal, s.buffer)}
	s.subscriptions[sub] = struct{}{}
	var snapshot []*pb.JobSummarySignal
	if s.snapshotRoles[role] {
		keys := make([]string, 0, len(s.jobs))
		for key := range s.jobs {
			keys = append(keys, key)
		}
		sort.Strings(keys)
		for _, key := range keys {
			snapshot = append(snapshot, s.jobs[key])
		}
	}
	s.lock.Unlock()
	defer func() {
		s.lock.Lock()
		delete(s.subscriptions, sub)
		delete(s.registered, info.ClientId)
		s.lock.Unlock()
	}()
	for _, message := range snapshot {
		if err := stream.Send(message); err != nil {
			return err
		}
	}
	atomic.AddInt64(&s.snapshots, int64(len(snapshot)))
	atomic.AddInt64(&s.up, 1)
	defer atomic.AddInt64(&s.up, -1)
	done := stream.Context().Done()
	for {
		select {
		case message := <-sub.messages:
			if err := stream.Send(message); err != nil {
				return err
			}
		case <-done:
			return stream.Context().Err()
		}
	}
}

// publishJob records a job's new state (a delete forgets the job) and publishes it.
func (s *server) publishJob(key string, message *pb.JobSummarySignal) {
	s.lock.Lock()
	defer s.lock.Unlock()
	if message.Operator == "delete" {
		delete(s.jobs, key)
	} else {
		s.jobs[key] = message
	}
	s.fanOut([]*pb.JobSummarySignal{message})
}

func (s *server) publish(messages []*pb.JobSummarySignal) {
	s.lock.Lock()
	defer s.lock.Unlock()
	s.fanOut(messages)
}

// fanOut queues the messages for every subscriber (the lock held).
func (s *server) fanOut(messages []*pb.JobSummarySignal) {
	var dropped int64
	for sub := range s.subscriptions {
		for _, message := range messages {
			select {
			case sub.messages <- message:
			default:
				dropped++
			}
		}
	}
	atomic.AddInt64(&s.published, int64(len(messages)))
	atomic.AddInt64(&s.dropped, dropped)
}

// levels: the queue lengths of up to levelSample subscribers, and how many there are.
func (s *server) levels() ([]int, int) {
	s.lock.Lock()
	defer s.lock.Unlock()
	levels := make([]int, 0, levelSample)
	for sub := range s.subscriptions {
		if len(levels) == levelSample {
			break
		}
		levels = append(levels, len(sub.messages))
	}
	return levels, len(s.subscriptions)
}

func (s *server) stats() map[string]interface{} {
	s.lock.Lock()
	defer s.lock.Unlock()
	pending := 0
	for sub := range s.subscriptions {
		pending += len(sub.messages)
	}
	return map[string]interface{}{
		"subscribers": atomic.LoadInt64(&s.up),
		"streams":     len(s.subscriptions),
		"published":   atomic.LoadInt64(&s.published),
		"pending":     pending,
		"dropped":     atomic.LoadInt64(&s.dropped),
		"snapshots":   atomic.LoadInt64(&s.snapshots),
		"jobs":        len(s.jobs),
		"ended":       map[string]int{},
	}
}

// -- the event driver ----------------------------------------------------------

type driver struct {
	server *server
	jobs   []*pb.JobSummarySignal // templates: every field but uuid and sid
	next   int
	stop   chan struct{}
}

func (d *driver) event(sid int64) *pb.JobSummarySignal {
	job := d.jobs[d.next%len(d.jobs)]
	d.next++
	return &pb.JobSummarySignal{
		Uuid: newUUID(), JobId: job.JobId, JobName: job.JobName, Namespace: job.Namespace,
		FrameWork: job.FrameWork, JobStatus: job.JobStatus, Time: job.Time, CmIndex: job.CmIndex,
		Total: job.Total, HcclJson: job.HcclJson, DeleteTime: job.DeleteTime,
		SharedTorIp: job.SharedTorIp, MasterAddr: job.MasterAddr, Operator: job.Operator,
		Sid: strconv.FormatInt(sid, 10),
	}
}

func (d *driver) rate(stop chan struct{}, rate float64) {
	interval := time.Duration(float64(time.Second) / rate)
	deadline := time.Now()
	for {
		d.server.publish([]*pb.JobSummarySignal{d.event(time.Now().UnixNano())})
		deadline = deadline.Add(interval)
		select {
		case <-stop:
			return
		case <-time.After(time.Until(deadline)):
		}
	}
}

// flood publishes whenever the queues (at `quantile`) hold fewer than
// `threshold` messages, or than the buffer when that is smaller.
func (d *driver) flood(stop chan struct{}, threshold, batch int, quantile float64) {
	if threshold > d.server.buffer {
		threshold = d.server.buffer
	}
	for {
		select {
		case <-stop:
			return
		default:
		}
		levels, subscribers := d.server.levels()
		level := 0
		if len(levels) > 0 {
			sort.Ints(levels)
			level = levels[int(quantile*float64(len(levels)-1))]
		}
		if level >= threshold {
			time.Sleep(time.Millisecond)
			continue
		}
		count := pushesPerBatch / subscribers
		if subscribers == 0 || count > batch {
			count = batch
		}
		if count < 1 {
			count = 1
		}
		now := time.Now().UnixNano()
		events := make([]*pb.JobSummarySignal, count)
		for i := range events {
			events[i] = d.event(now)
		}
		d.server.publish(events)
		runtime.Gosched()
	}
}

func number(command map[string]interface{}, key string) float64 {
	value, _ := command[key].(float64)
	return value
}

func (d *driver) handle(command map[string]interface{}) map[string]interface{} {
	name, _ := command["cmd"].(string)
	switch name {
	case "stats":
		return d.server.stats()
	case "mode":
		if d.stop != nil {
			close(d.stop)
			d.stop = nil
		}
		mode, _ := command["mode"].(string)
		if mode != "idle" && len(d.jobs) == 0 {
			return map[string]interface{}{"error": "no driver: the events come from -kube-url"}
		}
		switch mode {
		case "idle":
		case "rate":
			d.stop = make(chan struct{})
			go d.rate(d.stop, number(command, "rate"))
		case "flood":
			d.stop = make(chan struct{})
			go d.flood(
				d.stop, int(number(command, "threshold")), int(number(command, "batch")),
				number(command, "quantile"),
			)
		default:
			return map[string]interface{}{"error": fmt.Sprintf("unknown mode %q", mode)}
		}
		return map[string]interface{}{"ok": true}
	}
	return map[string]interface{}{"error": fmt.Sprintf("unknown command %q", name)}
}

func loadJobs(path string) ([]*pb.JobSummarySignal, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var fields []map[string]string
	if err := json.Unmarshal(data, &fields); err != nil {
		return nil, err
	}
	jobs := make([]*pb.JobSummarySignal, 0, len(fields))
	for _, f := range fields {
		jobs = append(jobs, &pb.JobSummarySignal{
			JobId: f["jobId"], JobName: f["jobName"], Namespace: f["namespace"],
			FrameWork: f["frameWork"], JobStatus: f["jobStatus"], Time: f["time"],
			CmIndex: f["cmIndex"], Total: f["total"], HcclJson: f["HcclJson"],
			DeleteTime: f["deleteTime"], SharedTorIp: f["sharedTorIp"],
			MasterAddr: f["masterAddr"], Operator: f["operator"],
		})
	}
	if len(jobs) == 0 {
		return nil, fmt.Errorf("no jobs in %s", path)
	}
	return jobs, nil
}

// watchKube loads the jobs of the Kubernetes API at base (LIST), then keeps them
// up to date (WATCH) on a goroutine of its own; returns once the LIST is loaded.
func watchKube(s *server, base, namespace string) error {
	watcher := kubewatch.New(base, namespace, func(job kubewatch.Job) {
		s.publishJob(job.Key, &pb.JobSummarySignal{
			Uuid: newUUID(), JobId: job.JobID, JobName: job.JobName, Namespace: job.Namespace,
			FrameWork: job.FrameWork, JobStatus: job.JobStatus, Time: job.Time,
			CmIndex: job.CmIndex, Total: job.Total, HcclJson: job.HcclJSON,
			DeleteTime: job.DeleteTime, SharedTorIp: job.SharedTorIP,
			MasterAddr: job.MasterAddr, Operator: job.Operator, Sid: job.Sid,
		})
	})
	if err := watcher.List(); err != nil {
		return err
	}
	go watcher.Run()
	return nil
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "reference: %v\n", err)
	os.Exit(2)
}

func main() {
	var jobsFile, kubeURL, namespace, snapshotRoles string
	var buffer int
	var deadline float64
	flag.StringVar(&jobsFile, "jobs-file", "", "JSON list of the jobs the driver publishes")
	flag.StringVar(&kubeURL, "kube-url", "", "Kubernetes API to watch instead (http://HOST:PORT)")
	flag.StringVar(&namespace, "namespace", "bench", "namespace of the ConfigMaps (-kube-url)")
	flag.StringVar(&snapshotRoles, "snapshot-roles", "FdAgent", "roles sent every job's state first")
	flag.IntVar(&buffer, "buffer", 10, "messages buffered per subscriber (ClusterD: 10)")
	flag.Float64Var(&deadline, "deadline", 600, "seconds until the process exits, whatever it is doing")
	flag.Parse()
	childproc.StopByItself(time.Duration(deadline * float64(time.Second)))
	var jobs []*pb.JobSummarySignal
	if kubeURL == "" {
		var err error
		if jobs, err = loadJobs(jobsFile); err != nil {
			fail(err)
		}
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail(err)
	}
	s := &server{
		buffer:        buffer,
		snapshotRoles: map[string]bool{},
		registered:    map[string]string{},
		subscriptions: map[*subscription]struct{}{},
		jobs:          map[string]*pb.JobSummarySignal{},
	}
	for _, role := range strings.Split(snapshotRoles, ",") {
		if role != "" {
			s.snapshotRoles[role] = true
		}
	}
	if kubeURL != "" {
		if err := watchKube(s, kubeURL, namespace); err != nil {
			fail(err)
		}
	}
	grpcServer := grpc.NewServer(grpc.MaxSendMsgSize(maxMessageBytes))
	pb.RegisterJobServer(grpcServer, s)
	go grpcServer.Serve(listener)
	d := &driver{server: s, jobs: jobs}
	childproc.Emit(map[string]interface{}{
		"ready": true, "port": listener.Addr().(*net.TCPAddr).Port, "pid": os.Getpid(),
	})
	childproc.AnswerCommands(d.handle)
	if d.stop != nil {
		close(d.stop)
	}
	grpcServer.Stop()
}
